"""DDP's gradient reducer after the warm-up (``grad_hooks.ReducerSwitch``), on 2 spawned
gloo ranks: off once ``local_sgd_grad_hook`` keeps gradients local, with the training
identical to PyTorch's ``post_localSGD_hook`` + ``PeriodicModelAverager``; on again
where gradients must be averaged or the reducer has other work."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import loss_of, make_model, params_of, train_step

LR = 0.05


def _counted(calls: list, wraps: bool = True):
    """``local_sgd_grad_hook``, counting the buckets DDP hands it; with ``wraps`` a
    ``functools.wraps`` wrapper, which declares that it hands the buckets through."""
    def hook(state, bucket):
        calls.append(1)
        return dah.grad_hooks.local_sgd_grad_hook(state, bucket)
    return functools.wraps(dah.grad_hooks.local_sgd_grad_hook)(hook) if wraps else hook


def _rank_parity(rank, world_size, steps, period, warmup):
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    ours, theirs = make_model(), make_model()
    ddp_ours, ddp_theirs = DDP(ours), DDP(theirs)
    handle = dah.register_averaging_hook(ddp_ours, dah.hooks.allreduce_hook, None,
                                         period=period, warmup_steps=warmup)
    calls: list = []
    ddp_ours.register_comm_hook(handle, _counted(calls))
    ddp_theirs.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD,
                          start_localSGD_iter=warmup, post_local_gradient_allreduce=False),
        post_localSGD_hook)
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    opt_ours = torch.optim.SGD(ddp_ours.parameters(), lr=LR, momentum=0.9)
    opt_theirs = torch.optim.SGD(ddp_theirs.parameters(), lr=LR, momentum=0.9)
    hook_calls, reducer_on, equal = [], [], []
    for step in range(steps):
        before = len(calls)
        train_step(ddp_ours, opt_ours, rank, step)
        hook_calls.append(len(calls) - before)
        handle.step()
        reducer_on.append(ddp_ours.require_backward_grad_sync)
        train_step(ddp_theirs, opt_theirs, rank, step)
        averager.average_parameters(ddp_theirs.parameters())
        equal.append(all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters())))
    handle.remove()
    return {"hook_calls": hook_calls, "reducer_on": reducer_on, "equal": equal,
            "after_remove": ddp_ours.require_backward_grad_sync, "params": params_of(ours)}


def test_reducer_is_off_after_the_warmup_and_training_matches_pytorch():
    steps, period, warmup = 12, 3, 4
    for res in run_ranks(_rank_parity, 2, steps=steps, period=period, warmup=warmup):
        assert all(res["equal"]), f"diverged from PyTorch: {res['equal']}"
        # the hook runs through the warm-up and at the first backward after it, then never
        assert all(n > 0 for n in res["hook_calls"][:warmup + 1]), res["hook_calls"]
        assert res["hook_calls"][warmup + 1:] == [0] * (steps - warmup - 1), res["hook_calls"]
        assert res["reducer_on"] == [s < warmup for s in range(steps)]
        assert res["after_remove"] is True


def _rank_back_to_warmup(rank, world_size):
    model = make_model()
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=4, warmup_steps=2)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    saved = None
    for step in range(6):
        train_step(ddp, opt, rank, step)
        handle.step()
        if step == 0:
            saved = handle.state_dict()  # step_count 1: inside the warm-up
    off = ddp.require_backward_grad_sync
    handle.load_state_dict(saved)
    on = ddp.require_backward_grad_sync
    # back in the warm-up: this backward averages the gradients (the ranks' batches differ)
    opt.zero_grad()
    loss_of(ddp, rank, 7).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return {"off": off, "on": on, "grads": grads}


def test_back_in_the_warmup_the_reducer_averages_gradients_again():
    a, b = run_ranks(_rank_back_to_warmup, 2)
    assert a["off"] is False and a["on"] is True
    for ga, gb in zip(a["grads"], b["grads"]):
        torch.testing.assert_close(ga, gb)


class _WithBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = make_model()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        return self.inner(x)


def _rank_kept_on(rank, world_size, case):
    if case == "buffers":
        model = _WithBuffer()
        ddp = DDP(model)  # broadcasts rank 0's buffers at every synchronized forward
    elif case == "unused":
        model = make_model()
        ddp = DDP(model, find_unused_parameters=True)
    else:  # a hook of the user's own that calls local_sgd_grad_hook
        model = make_model()
        ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=2, warmup_steps=1)
    calls: list = []
    ddp.register_comm_hook(handle, _counted(calls, wraps=case != "own_hook"))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(5):
        train_step(ddp, opt, rank, step)
        handle.step()
    return {"on": ddp.require_backward_grad_sync, "calls": len(calls),
            "why": handle.reducer_switch.reducer_needed(),
            "released": not handle.reducer_switch.active}


def test_the_reducer_stays_on_where_it_has_other_work():
    for case, why in [("buffers", "broadcast_buffers=True on a module with buffers"),
                      ("unused", "find_unused_parameters=True"),
                      ("own_hook", "the registered comm hook is not local_sgd_grad_hook")]:
        for res in run_ranks(_rank_kept_on, 2, case=case):
            assert res["on"] is True and res["why"].startswith(why), res
            assert res["calls"] >= 5  # the hook ran at every backward
            assert res["released"]  # asked once, then the switch gave up for good


def _rank_integration(rank, world_size):
    from ddp_avg_hooks.integrations._common import GradSync, detach

    model = make_model()
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=2, warmup_steps=1)
    GradSync.attach(ddp, handle)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(3):
        train_step(ddp, opt, rank, step)
        handle.step()
    off = ddp.require_backward_grad_sync
    detach(ddp)  # from here DDP averages gradients every step, as plain DDP
    on = ddp.require_backward_grad_sync
    handle.remove()
    return {"off": off, "on": on}


def test_an_integration_detaching_its_handle_turns_the_reducer_back_on():
    for res in run_ranks(_rank_integration, 2):
        assert res["off"] is False and res["on"] is True


def _rank_freed(rank, world_size):
    import gc
    import weakref

    model = make_model()
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=2, warmup_steps=1)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(3):
        train_step(ddp, opt, rank, step)
        handle.step()
    skipping = handle.reducer_switch.skipping
    gone = weakref.ref(ddp)
    del ddp, handle, opt
    gc.collect()
    return {"skipping": skipping, "freed": gone() is None}


def test_the_switch_does_not_keep_the_model_alive():
    # DDP's reducer holds the hook's state (the handle): a strong reference from the
    # handle back to the DDP model would make a cycle through C++ that never is freed
    (res,) = run_ranks(_rank_freed, 1)
    assert res == {"skipping": True, "freed": True}
