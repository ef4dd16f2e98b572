"""``AveragingOptimizer`` on 2 gloo ranks: the same as using the handle by hand, with an LR
scheduler, and a plain optimizer checkpoint that resumes averaging exactly."""

from __future__ import annotations

import io

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import flat, loss_of as _loss, make_model

STEPS, CKPT_AT = 10, 4  # rounds after steps 2, 5, 8 (warm-up 2, period 3)


def _setup(wrapped: bool):
    ddp = DDP(make_model())
    inner = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook,
                                         dah.hooks.HalfDeltaState(), period=3, warmup_steps=2)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    opt = dah.AveragingOptimizer(inner, handle) if wrapped else inner
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return ddp, opt, handle, sched


def _by_hand(rank):
    ddp, opt, handle, sched = _setup(wrapped=False)
    lrs = []
    for step in range(STEPS):
        opt.zero_grad(); _loss(ddp, rank, step).backward(); opt.step()
        handle.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return flat(ddp.module), lrs, handle.stats.rounds


def _wrapped(rank, ckpt_at=None):
    ddp, opt, handle, sched = _setup(wrapped=True)
    lrs = []
    for step in range(STEPS):
        if step == ckpt_at:  # a plain checkpoint: model, optimizer, scheduler
            buf = io.BytesIO()
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, buf)
            handle.remove()
            ddp, opt, handle, sched = _setup(wrapped=True)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            ddp.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            sched.load_state_dict(saved["sched"])
        opt.zero_grad()
        opt.step(lambda: _loss(ddp, rank, step).backward())
        sched.step()
        lrs.append(opt.optimizer.param_groups[0]["lr"])  # what the inner optimizer sees
    return flat(ddp.module), lrs, handle.step_count


def _rank_optim(rank, world_size):
    by_hand, wrapped, resumed = _by_hand(rank), _wrapped(rank), _wrapped(rank, ckpt_at=CKPT_AT)
    return {"by_hand": by_hand, "wrapped": wrapped, "resumed": resumed}


def test_wrapper_equals_the_handle_by_hand_schedules_lr_and_resumes_from_its_state_dict():
    ranks = run_ranks(_rank_optim, world_size=2)
    expected_lrs = [0.1 * 0.5 ** ((s + 1) // 3) for s in range(STEPS)]
    for r in ranks:
        params, lrs, rounds = r["by_hand"]
        assert rounds == 3 and r["wrapped"][2] == r["resumed"][2] == STEPS
        torch.testing.assert_close(lrs, expected_lrs, rtol=0, atol=1e-12)
        for case in ("wrapped", "resumed"):
            assert torch.equal(r[case][0], params), case  # bit for bit
            assert r[case][1] == lrs, case
    # local steps since step 8
    assert not torch.equal(ranks[0]["by_hand"][0], ranks[1]["by_hand"][0])


# --- without peers ----------------------------------------------------------------------
def test_is_a_real_optimizer_sharing_the_inner_state(world1):
    ddp = DDP(make_model())
    inner = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
    opt = dah.AveragingOptimizer(inner, handle)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.state is inner.state
    assert opt.defaults is inner.defaults
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", handle.step_count)))
    opt.register_step_post_hook(lambda o, a, k: calls.append(("post", handle.step_count)))
    loss = opt.step(lambda: _loss(ddp, 0, 0).backward() or torch.tensor(1.5))
    assert loss.item() == 1.5 and calls == [("pre", 0), ("post", 1)]
    assert inner.state[next(iter(ddp.parameters()))]["step"] == 1
    opt.zero_grad()
    assert all(p.grad is None for p in ddp.parameters())
    extra = torch.nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra]})
    assert inner.param_groups[-1]["params"] == [extra]
    seen = []
    opt.register_state_dict_post_hook(lambda o, sd: seen.append(sorted(sd)))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("loaded"))
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    assert seen == [["averaging", "param_groups", "state"], "loaded"]
    assert "AveragingOptimizer" in repr(opt) and "Adam" in repr(opt)
    # a plain optimizer's checkpoint: loads, warns, the handle keeps its counter
    with pytest.warns(UserWarning, match="no 'averaging' entry"):
        opt.load_state_dict(inner.state_dict())
    assert handle.step_count == 1
    handle.remove()


def test_double_stepping_is_refused(world1):
    ddp = DDP(make_model())
    inner = torch.optim.SGD(ddp.parameters(), lr=0.1)
    attached = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, optimizer=inner)
    with pytest.raises(ValueError, match="registered with optimizer="):
        dah.AveragingOptimizer(inner, attached)
    attached.remove()
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    opt = dah.AveragingOptimizer(inner, handle)
    with pytest.raises(ValueError, match="already wraps the same handle"):
        dah.AveragingOptimizer(opt, handle)
    handle.attach_optimizer(inner)  # attached after wrapping: caught at the next step
    with pytest.raises(ValueError, match="twice per step"):
        opt.step()
    assert handle.step_count == 0
    handle.remove()
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        dah.AveragingOptimizer(object(), handle)
    with pytest.raises(TypeError, match="AveragingHandle"):
        dah.AveragingOptimizer(inner, object())
    fresh = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    with pytest.raises(ValueError, match="AveragingOptimizer: the optimizer"):
        dah.AveragingOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), fresh)
    fresh.remove()
