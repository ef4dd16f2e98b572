"""The registry on 2 and 3 spawned gloo ranks, checked against independent references:
a single-process computation in the parent, plain DDP, and PyTorch's own averagers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import loss_of, make_model, params_of, train_step

LR = 0.05



# --- period 1 == DDP gradient averaging ----------------------------------------------
def _rank_period1(rank, world_size, steps):
    ours, plain = make_model(), make_model()
    ddp, ddp_plain = DDP(ours), DDP(plain)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=1)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    opt_plain = torch.optim.SGD(ddp_plain.parameters(), lr=LR)
    for step in range(steps):
        train_step(ddp, opt, rank, step)
        handle.step()
        train_step(ddp_plain, opt_plain, rank, step)
    return {"ours": params_of(ours), "ddp": params_of(plain), "rounds": handle.stats.rounds}


def _reference_gradient_averaging(world_size, steps):
    model = make_model()
    for step in range(steps):
        grads = []
        for r in range(world_size):
            model.zero_grad()
            loss_of(model, r, step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p -= LR * torch.stack([g[i] for g in grads]).mean(0)
    return params_of(model)


@pytest.mark.parametrize("world_size", [2, 3])
def test_period_one_equals_ddp_gradient_averaging(world_size):
    steps = 6
    results = run_ranks(_rank_period1, world_size, steps=steps)
    reference = _reference_gradient_averaging(world_size, steps)
    for res in results:
        assert res["rounds"] == steps
        for ours, ddp, ref in zip(res["ours"], res["ddp"], reference):
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(ours, ddp, rtol=1e-5, atol=1e-6)


# --- identical to PeriodicModelAverager + post_localSGD_hook --------------------------
def _rank_torch_parity(rank, world_size, steps, period, warmup):
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
        PostLocalSGDState,
        post_localSGD_hook,
    )
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    ours, theirs = make_model(), make_model()
    ddp_ours, ddp_theirs = DDP(ours), DDP(theirs)
    handle = dah.register_averaging_hook(ddp_ours, dah.hooks.allreduce_hook, None,
                                         period=period, warmup_steps=warmup)
    ddp_ours.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    ddp_theirs.register_comm_hook(
        PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD,
                          start_localSGD_iter=warmup, post_local_gradient_allreduce=False),
        post_localSGD_hook,
    )
    averager = PeriodicModelAverager(period=period, warmup_steps=warmup)
    opt_ours = torch.optim.SGD(ddp_ours.parameters(), lr=LR, momentum=0.9)
    opt_theirs = torch.optim.SGD(ddp_theirs.parameters(), lr=LR, momentum=0.9)
    equal, averaged = [], []
    for step in range(steps):
        train_step(ddp_ours, opt_ours, rank, step)
        averaged.append(handle.step())
        train_step(ddp_theirs, opt_theirs, rank, step)
        averager.average_parameters(ddp_theirs.parameters())
        equal.append(all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters())))
    return {"equal": equal, "averaged": averaged, "params": params_of(ours)}


def test_identical_to_periodic_model_averager_with_warmup_and_momentum():
    steps, period, warmup = 12, 3, 4
    results = run_ranks(_rank_torch_parity, 2, steps=steps, period=period, warmup=warmup)
    for res in results:
        assert all(res["equal"]), f"diverged from PyTorch at steps {res['equal']}"
        assert res["averaged"] == [s >= warmup and (s - warmup) % period == 0 for s in range(steps)]
    # and local SGD really happened: ranks differed between rounds
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"])) \
        or results[0]["averaged"][-1]


# --- ranks identical right after a round, different between rounds -------------------
def _rank_identical_after_rounds(rank, world_size, steps, period):
    model = make_model()
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=period)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    ptrs = [p.data_ptr() for p in model.parameters()]
    snaps = []
    for step in range(steps):
        train_step(ddp, opt, rank, step)
        handle.step()
        snaps.append(params_of(model))
    assert ptrs == [p.data_ptr() for p in model.parameters()]
    return snaps


def _reference_local_sgd(world_size, steps, period, opt_factory=None, warmup=0):
    """Replicas trained one after another; averaged with torch.stack().mean(0)."""
    opt_factory = opt_factory or (lambda ps: torch.optim.SGD(ps, lr=LR))
    replicas = [make_model() for _ in range(world_size)]
    opts = [opt_factory(m.parameters()) for m in replicas]
    history = []
    for step in range(steps):
        for r, (m, o) in enumerate(zip(replicas, opts)):
            train_step(m, o, r, step)
        if step >= warmup and (step - warmup) % period == 0:
            with torch.no_grad():
                for ps in zip(*(m.parameters() for m in replicas)):
                    mean = torch.stack([p.detach() for p in ps]).mean(0)
                    for p in ps:
                        p.copy_(mean)
        history.append([params_of(m) for m in replicas])
    return history


def test_ranks_bit_identical_after_rounds_and_different_between():
    world_size, steps, period = 3, 7, 3
    results = run_ranks(_rank_identical_after_rounds, world_size, steps=steps, period=period)
    reference = _reference_local_sgd(world_size, steps, period)
    for step in range(steps):
        same = all(
            torch.equal(a, b)
            for r in range(1, world_size)
            for a, b in zip(results[0][step], results[r][step])
        )
        assert same == (step % period == 0), f"step {step}"
        for r in range(world_size):
            for got, ref in zip(results[r][step], reference[step][r]):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# --- optimizer= mode with Adam ------------------------------------------------------
def _rank_adam(rank, world_size, steps, period):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=period,
                                         optimizer=opt)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    for step in range(steps):
        train_step(ddp, opt, rank, step)
    return {"params": params_of(model), "steps": handle.step_count, "rounds": handle.stats.rounds}


def test_optimizer_mode_with_adam_matches_reference():
    world_size, steps, period = 2, 7, 3
    results = run_ranks(_rank_adam, world_size, steps=steps, period=period)
    reference = _reference_local_sgd(world_size, steps, period,
                                     lambda ps: torch.optim.Adam(ps, lr=0.01))[-1]
    for r, res in enumerate(results):
        assert res["steps"] == steps and res["rounds"] == 3
        for got, ref in zip(res["params"], reference[r]):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# --- mixed dtypes, channels_last, frozen parameters: closed-form averages -------------
class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.conv.to(memory_format=torch.channels_last)
        self.head = torch.nn.Linear(6, 2).to(torch.bfloat16)
        self.frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)


def _rank_mixed(rank, world_size):
    model = Mixed()
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    layout = [(p.data_ptr(), p.stride(), p.dtype,
               p.is_contiguous(memory_format=torch.channels_last))
              for p in model.parameters()]
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            g = torch.Generator().manual_seed(i)
            p.copy_((torch.randint(-8, 8, p.shape, generator=g) + rank) * world_size)
    handle.average()
    after = [(p.data_ptr(), p.stride(), p.dtype, p.is_contiguous(memory_format=torch.channels_last))
             for p in model.parameters()]
    return {"layout": layout, "after": after, "params": params_of(model),
            "buckets": [(b.dtype, len(b.parameters())) for b in handle.buckets]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_mixed_dtypes_channels_last_and_frozen(world_size):
    results = run_ranks(_rank_mixed, world_size)
    mean_rank = (world_size - 1) / 2
    names = [n for n, _ in Mixed().named_parameters()]
    shapes = [p.shape for p in Mixed().parameters()]
    for r, res in enumerate(results):
        assert res["layout"] == res["after"]
        assert res["buckets"] == [(torch.float32, 2), (torch.bfloat16, 2)]
        for i, (name, p, shape) in enumerate(zip(names, res["params"], shapes)):
            g = torch.Generator().manual_seed(i)
            base = torch.randint(-8, 8, shape, generator=g)
            # the frozen parameter is not averaged: it keeps its own rank's value
            expected = (base + (r if name == "frozen" else mean_rank)) * world_size
            assert torch.equal(p, expected.to(p.dtype)), name


# --- subgroups and two registrations at different periods ----------------------------
def _rank_two_registrations(rank, world_size, steps):
    pair = dist.new_group([0, 1])
    model = make_model()
    ddp = DDP(model)
    local = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, pair, period=2)
    world = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=4)
    ddp.register_comm_hook(world, dah.grad_hooks.local_sgd_grad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    history = []
    for step in range(steps):
        train_step(ddp, opt, rank, step)
        local.step()
        world.step()
        history.append(params_of(model))
    return {"history": history, "local_bytes": local.stats.bytes_sent,
            "world_bytes": world.stats.bytes_sent}


def test_subgroup_and_two_registrations_at_different_periods():
    world_size, steps = 3, 7
    results = run_ranks(_rank_two_registrations, world_size, steps=steps)
    # independent reference: replicas in one process, pair mean every 2, world mean every 4
    replicas = [make_model() for _ in range(world_size)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in replicas]

    def average(members):
        with torch.no_grad():
            for ps in zip(*(replicas[r].parameters() for r in members)):
                mean = torch.stack([p.detach() for p in ps]).mean(0)
                for p in ps:
                    p.copy_(mean)

    nbytes = sum(p.numel() * 4 for p in replicas[0].parameters())
    for step in range(steps):
        for r in range(world_size):
            train_step(replicas[r], opts[r], r, step)
        if step % 2 == 0:
            average([0, 1])
        if step % 4 == 0:
            average(range(world_size))
        for r in range(world_size):
            for got, ref in zip(results[r]["history"][step], replicas[r].parameters()):
                torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)
        pair_same = all(torch.equal(a, b) for a, b in
                        zip(results[0]["history"][step], results[1]["history"][step]))
        assert pair_same == (step % 2 == 0)
    assert results[2]["local_bytes"] == 0  # outside the pair: sends nothing, changes nothing
    assert results[0]["local_bytes"] == 4 * nbytes and results[0]["world_bytes"] == 2 * nbytes


# --- ranks must agree at registration -------------------------------------------------
def _rank_disagree(rank, world_size, what):
    ddp = DDP(torch.nn.Linear(4, 2))
    period = 4 if (what == "period" and rank == 1) else 2
    hook = dah.hooks.allreduce_hook
    if what == "hook" and rank == 1:
        hook = _other_hook
    try:
        dah.register_averaging_hook(ddp, hook, None, period=period)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _other_hook(state, bucket):
    return dah.hooks.allreduce_hook(state, bucket)


def _rank_layout_mismatch(rank, world_size):
    # DDP itself refuses different shapes, so disagree on which parameters are trainable.
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Linear(2, 2))
    ddp = DDP(model)
    if rank == 1:
        model[1].weight.requires_grad_(False)
    try:
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("what", ["period", "hook"])
def test_every_rank_raises_on_disagreement(what):
    messages = run_ranks(_rank_disagree, 2, timeout_s=60, what=what)
    for msg in messages:
        assert f"ranks disagree on {what!r}" in msg and "ranks [1]" in msg, msg


def test_every_rank_raises_on_layout_disagreement():
    messages = run_ranks(_rank_layout_mismatch, 2, timeout_s=60)
    for msg in messages:
        assert "ranks disagree on 'layout'" in msg and "ranks [1]" in msg, msg


def _rank_missing_registration(rank, world_size):
    ddp = DDP(torch.nn.Linear(2, 2))
    if rank == 1:
        return "skipped"
    try:
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_rank_that_never_registers_gives_an_error_not_a_hang():
    messages = run_ranks(_rank_missing_registration, 2, timeout_s=60, pg_timeout_s=3,
                         hard_exit=True)
    assert "did every rank of the group register" in messages[0]


# --- a warm-up that left the replicas apart ----------------------------------------
@dah.averaging_hook(needs_anchor=True)
def _exact_delta_hook(state, bucket):
    """The exact average of the change since the anchor (what the compressed hooks send
    in fewer bytes): ``anchor - mean(anchor - params)``."""
    delta = bucket.delta(scale=1 / dist.get_world_size())
    bucket.mark_result_as_delta()
    return dist.all_reduce(delta, async_op=True).get_future().then(lambda f: f.value()[0])


def _keep_local(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _rank_warmup_apart(rank, world_size, grads_averaged):
    import warnings

    model = make_model()
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, _exact_delta_hook, None, period=2, warmup_steps=3)
    ddp.register_comm_hook(*((handle, dah.grad_hooks.local_sgd_grad_hook) if grads_averaged
                             else (None, _keep_local)))  # a comm hook that keeps them local
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):  # 3 warm-up steps, then the first round
            train_step(ddp, opt, rank, step)
            handle.step()
    return {"params": params_of(model), "rounds": handle.stats.rounds,
            "warned": [str(w.message) for w in caught if "end of the warm-up" in str(w.message)]}


def test_replicas_apart_after_the_warm_up_meet_at_the_first_round_with_a_warning():
    out = run_ranks(_rank_warmup_apart, 2, timeout_s=60, grads_averaged=False)
    # reference: each replica trained on its own batches for 4 steps, then their average
    replicas = []
    for r in range(2):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(4):
            train_step(model, opt, r, step)
        replicas.append(params_of(model))
    for rank in out:
        assert rank["rounds"] == 1 and len(rank["warned"]) == 1
        assert "gradients were not averaged during it" in rank["warned"][0]
        assert "local_sgd_grad_hook" in rank["warned"][0]
        for p, a, b in zip(rank["params"], *replicas):
            torch.testing.assert_close(p, (a + b) / 2, rtol=0, atol=1e-6)
    for p, q in zip(out[0]["params"], out[1]["params"]):
        assert torch.equal(p, q)
    # averaged gradients in the warm-up: identical replicas, no warning
    for rank in run_ranks(_rank_warmup_apart, 2, timeout_s=60, grads_averaged=True):
        assert rank["rounds"] == 1 and rank["warned"] == []


def _rank_apart_at_registration(rank, world_size):
    import warnings

    model = make_model()
    ddp = DDP(model)
    ddp.register_comm_hook(None, _keep_local)
    with torch.no_grad():  # replicas made to differ after DDP's broadcast
        for p in model.parameters():
            p.add_(0.01 * (rank + 1))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = dah.register_averaging_hook(ddp, _exact_delta_hook, None, period=2)
    train_step(ddp, opt, rank, 0)
    handle.step()  # the first round (no warm-up)
    return {"params": params_of(model), "rounds": handle.stats.rounds,
            "warned": [str(w.message) for w in caught if "at registration" in str(w.message)]}


def test_replicas_apart_at_registration_meet_at_the_first_round_with_a_warning():
    out = run_ranks(_rank_apart_at_registration, 2, timeout_s=60)
    replicas = []
    for r in range(2):  # reference: each replica's own step from its own start, averaged
        model = make_model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (r + 1))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        train_step(model, opt, r, 0)
        replicas.append(params_of(model))
    for rank in out:
        assert rank["rounds"] == 1 and len(rank["warned"]) == 1
        assert "initialize alike" in rank["warned"][0]
        for p, a, b in zip(rank["params"], *replicas):
            torch.testing.assert_close(p, (a + b) / 2, rtol=0, atol=1e-6)


def _rank_register_again(rank, world_size):
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    synced = []

    def step(handle, s):
        opt.zero_grad()
        loss_of(ddp, rank, s).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        both = [torch.empty_like(grad) for _ in range(world_size)]
        dist.all_gather(both, grad)
        synced.append(torch.equal(both[0], both[1]))  # the ranks' batches differ
        opt.step()
        if handle is not None:
            handle.step()

    first = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                        warmup_steps=1)
    ddp.register_comm_hook(first, dah.grad_hooks.local_sgd_grad_hook)  # once, for good
    for s in range(3):
        step(first, s)
    first.remove()
    step(None, 3)
    second = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         warmup_steps=2)
    assert first.successor is second and second.successor is None
    for s in range(4, 8):
        step(second, s)
    rounds = second.stats.rounds
    second.remove()
    step(None, 8)
    return synced, rounds


def test_the_comm_hook_follows_a_handle_registered_again_after_remove():
    # DDP takes one comm hook per model: after remove() it averages every step, as plain
    # DDP does, and follows the warm-up of the next registration on the model
    for synced, rounds in run_ranks(_rank_register_again, 2, timeout_s=60):
        assert synced == [True, False, False, True, True, True, False, False, True]
        assert rounds == 1  # at the third step of the second registration (warm-up 2)


# --- a model cast or moved after registration ---------------------------------------------
def _rank_cast(rank, world_size, offload):
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         offload_state=offload, average_buffers=True)
    model.double()  # DDP's own buckets do not follow either
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point():
                t.add_(1 / 3)  # not a float32 number
    before = [t.detach().clone() for t in model.state_dict().values()]
    out = {}
    try:
        handle.average()
        out["refused"] = None
    except RuntimeError as exc:
        out["refused"] = str(exc)
    out["unchanged"] = all(torch.equal(a, b) for a, b in
                           zip(before, model.state_dict().values()))
    out["rounds"] = handle.stats.rounds
    handle.remove()
    handle = dah.register_averaging_hook(DDP(model), dah.hooks.allreduce_hook, None, period=2,
                                         offload_state=offload, average_buffers=True)
    handle.average()  # registered again: rounds in float64
    out["before"], out["after"] = before, list(model.state_dict().values())
    return out


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offloaded"])
def test_a_model_cast_after_registration_is_refused_until_registered_again(offload):
    # the default storage keeps a bucket's dtype: without the check the rounds of a model
    # cast to float64 ran in float32, silently; now every rank refuses with the fix,
    # nothing changed, and a registration after the cast averages in float64 (checked
    # against the mean of the ranks' values computed here)
    outs = run_ranks(_rank_cast, 2, 90.0, 20.0, offload=offload)
    for out in outs:
        assert out["refused"] is not None, "a round ran on a cast model"
        assert "torch.float64" in out["refused"] and "register again" in out["refused"]
        assert out["unchanged"] and out["rounds"] == 0
    for i, (a, b) in enumerate(zip(outs[0]["before"], outs[1]["before"])):
        if not a.is_floating_point():
            continue
        assert a.dtype == torch.float64
        mean = (a + b) / 2
        for out in outs:
            assert torch.equal(out["after"][i], mean), i
