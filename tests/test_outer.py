"""``hooks.outer_optimizer``: DiLoCo / SlowMo over the averaging hooks, on 2 gloo ranks,
checked against plain averaging and a hand-written single-process reference."""

from __future__ import annotations

import io

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from ddp_avg_hooks.rounds import run_round
from _helpers import batch, flat, make_model

LR = 0.05
PERIOD = 3
STEPS = 7  # rounds after steps 0, 3, 6: the last step ends with a round
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def make_model_like(vector: torch.Tensor) -> list[torch.Tensor]:
    """``vector`` split into tensors shaped like ``make_model()``'s parameters."""
    shapes = [p.shape for p in make_model().parameters()]
    return [t.view(s) for t, s in zip(vector.split([s.numel() for s in shapes]), shapes)]


def _train(rank, hook, state, steps, *, momentum=0.0, ckpt_at=None):
    """Local SGD with ``hook``; with ``ckpt_at``, stop there, save everything, rebuild and
    resume."""
    def build():
        ddp = DDP(make_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=momentum)
        handle = dah.register_averaging_hook(ddp, hook, state(), period=PERIOD,
                                             bucket_cap_mb=100 / 2**20)  # several buckets
        ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
        return ddp, opt, handle

    ddp, opt, handle = build()
    assert len(handle.buckets) > 1
    for step in range(steps):
        if step == ckpt_at:
            buf = io.BytesIO()
            torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                        "avg": handle.state_dict()}, buf)
            handle.remove()
            ddp, opt, handle = build()  # a fresh registration, then restore
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)  # plain tensors and values only
            ddp.module.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            handle.load_state_dict(saved["avg"])
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        handle.step()
    return flat(ddp.module), handle.stats.rounds, handle.state.state_dict() if hasattr(
        handle.state, "state_dict") else None


def _outer(inner_state=None, **kw):
    return lambda: dah.hooks.OuterOptimizerState(inner_state() if inner_state else None, **kw)


def _rank_outer(rank, world_size):
    allreduce = dah.hooks.allreduce_hook
    outer = dah.hooks.outer_optimizer
    psgd = lambda: dah.hooks.PowerSGDState(matrix_approximation_rank=1)  # noqa: E731
    out = {
        "plain": _train(rank, allreduce, lambda: None, STEPS)[0],
        "sgd_lr1": _train(rank, outer(allreduce), _outer(lr=1.0, momentum=0.0), STEPS)[0],
    }
    params, rounds, state = _train(rank, outer(allreduce), _outer(), STEPS)  # DiLoCo defaults
    out.update(diloco=params, rounds=rounds,
               momentum=state["buckets"][0]["state"][0]["momentum_buffer"])
    out["fp16"] = _train(rank, outer(dah.hooks.fp16_compress_hook),
                         _outer(dah.hooks.HalfDeltaState), STEPS)[0]
    out["powersgd"] = _train(rank, outer(dah.hooks.powersgd_hook), _outer(psgd), STEPS)[0]
    # checkpoint mid-period (step 5, between the rounds of steps 3 and 6), Adam outer and inner
    # momentum
    adam = _outer(psgd, optimizer=torch.optim.Adam, lr=0.3)
    out["resume_straight"] = _train(rank, outer(dah.hooks.powersgd_hook), adam, STEPS,
                                    momentum=0.9)[0]
    out["resume_ckpt"] = _train(rank, outer(dah.hooks.powersgd_hook), adam, STEPS, momentum=0.9,
                                ckpt_at=5)[0]
    return out


def _reference(world_size, steps):
    """Independent single-process math: replicas, mean, hand-written Nesterov SGD outer step."""
    replicas = [make_model() for _ in range(world_size)]
    plain = [make_model() for _ in range(world_size)]
    anchor, buf = flat(replicas[0]), None

    def local_step(model, rank, step):
        x, y = batch(rank, step)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad

    def load(model, vector):  # copies (vector_to_parameters would make the replicas share storage)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(vector.clone(), model.parameters())

    for step in range(steps):
        for rank in range(world_size):
            local_step(replicas[rank], rank, step)
            local_step(plain[rank], rank, step)
        if step % PERIOD == 0:
            mean = torch.stack([flat(m) for m in plain]).mean(0)
            for m in plain:
                load(m, mean)
            g = anchor - torch.stack([flat(m) for m in replicas]).mean(0)  # pseudo-gradient
            buf = g.clone() if buf is None else OUTER_MOMENTUM * buf + g
            anchor = anchor - OUTER_LR * (g + OUTER_MOMENTUM * buf)  # Nesterov
            for m in replicas:
                load(m, anchor)
    return {"plain": [flat(m) for m in plain], "diloco": [flat(m) for m in replicas],
            "momentum": buf}


def test_outer_optimizer_on_two_ranks_matches_plain_averaging_and_the_reference():
    ranks = run_ranks(_rank_outer, world_size=2)
    ref = _reference(2, STEPS)
    tight = dict(rtol=1e-5, atol=1e-6)
    for rank, r in enumerate(ranks):
        # SGD lr 1 without momentum is plain averaging
        torch.testing.assert_close(r["sgd_lr1"], r["plain"], **tight)
        torch.testing.assert_close(r["plain"], ref["plain"][rank], **tight)
        # DiLoCo's Nesterov SGD matches the hand-written outer step
        assert r["rounds"] == 3
        torch.testing.assert_close(r["diloco"], ref["diloco"][rank], **tight)
        # the momentum of the first bucket (the first layer's weight) is the reference's
        n = r["momentum"].numel()
        torch.testing.assert_close(r["momentum"], ref["momentum"][:n], **tight)
        # fp16 deltas: the same trajectory within half-precision rounding
        torch.testing.assert_close(r["fp16"], ref["diloco"][rank], rtol=0, atol=2e-3)
        assert torch.isfinite(r["powersgd"]).all()
        # a checkpoint (PowerSGD Q + error feedback, Adam outer state) resumes bit for bit
        assert torch.equal(r["resume_ckpt"], r["resume_straight"])
    assert (ranks[0]["diloco"] - ref["plain"][0]).abs().max() > 1e-2  # the outer step did something
    for key in ("sgd_lr1", "diloco", "fp16", "powersgd", "resume_ckpt"):
        assert torch.equal(ranks[0][key], ranks[1][key]), key  # every round ends in agreement


# --- without peers ----------------------------------------------------------------------
def test_state_and_hook_validation(world1):
    ddp = DDP(make_model())
    hook = dah.hooks.outer_optimizer(dah.hooks.allreduce_hook)
    with pytest.raises(TypeError, match="OuterOptimizerState"):
        dah.register_averaging_hook(ddp, hook, None)
    with pytest.raises(TypeError, match="allreduce_hook: state must be None"):
        dah.register_averaging_hook(ddp, hook, dah.hooks.OuterOptimizerState("bad"))
    with pytest.raises(TypeError, match="the inner state, OuterOptimizerState's first "
                       "argument, is not one the inner hook takes: .*PowerSGDState"):
        dah.register_averaging_hook(ddp, dah.hooks.outer_optimizer(dah.hooks.powersgd_hook),
                                    dah.hooks.OuterOptimizerState())
    with pytest.raises(TypeError, match="factory must set them"):
        dah.hooks.OuterOptimizerState(None, lambda ps: torch.optim.SGD(ps, lr=1), lr=2)
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        dah.hooks.OuterOptimizerState(None, lambda ps: None)
    with pytest.raises(TypeError, match="optimizer must be None"):
        dah.hooks.OuterOptimizerState(None, 3)
    with pytest.raises(TypeError, match="inner_hook must be callable"):
        dah.hooks.outer_optimizer(None)
    state = dah.hooks.OuterOptimizerState(momentum=0)
    assert state.optimizer_kwargs == {"lr": 0.7, "momentum": 0, "nesterov": False}
    handle = dah.register_averaging_hook(ddp, hook, state, bucket_cap_mb=100 / 2**20)
    assert "outer_optimizer(ddp_avg_hooks.hooks.default.allreduce_hook)" in repr(handle)
    # created eagerly at registration (the hook's prepare_bucket), one per bucket
    assert sorted(state.optimizers) == list(range(len(handle.buckets))) != [0]
    handle.remove()


def test_state_dict_loads_before_the_buckets_exist_and_checks_the_optimizer(world1):
    def run(state, steps, load=None):
        ddp = DDP(make_model())
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        bucket = dah.bucket.ParamBucket(0, list(ddp.parameters()), is_last=True, keep_anchor=True)
        if load is not None:
            state.load_state_dict(load)  # before prepare: kept, applied at the first use
        hook = dah.hooks.outer_optimizer(dah.hooks.allreduce_hook)
        for step in range(steps):
            x, y = batch(0, step)
            opt.zero_grad(); torch.nn.functional.mse_loss(ddp(x), y).backward(); opt.step()
            run_round(hook, state, [bucket])
        return flat(ddp.module), state

    straight, _ = run(dah.hooks.OuterOptimizerState(), 4)
    _, half = run(dah.hooks.OuterOptimizerState(), 2)
    saved = half.state_dict()
    assert saved["buckets"][0]["state"][0]["momentum_buffer"].abs().sum() > 0
    fresh = dah.hooks.OuterOptimizerState()
    fresh.load_state_dict(saved)
    assert fresh.state_dict()["buckets"].keys() == {0}  # pending, still saved
    # a fresh model continuing from the reference's parameters after 2 steps
    ddp = DDP(make_model())
    after_two = make_model_like(run(dah.hooks.OuterOptimizerState(), 2)[0])
    with torch.no_grad():
        for p, v in zip(ddp.module.parameters(), after_two):
            p.copy_(v)
    bucket = dah.bucket.ParamBucket(0, list(ddp.parameters()), is_last=True, keep_anchor=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    hook = dah.hooks.outer_optimizer(dah.hooks.allreduce_hook)
    for step in range(2, 4):
        x, y = batch(0, step)
        opt.zero_grad(); torch.nn.functional.mse_loss(ddp(x), y).backward(); opt.step()
        run_round(hook, fresh, [bucket])
    assert torch.equal(flat(ddp.module), straight)
    with pytest.raises(ValueError, match="outer optimizer is SGD, this state's Adam"):
        dah.hooks.OuterOptimizerState(None, torch.optim.Adam).load_state_dict(saved)
    with pytest.raises(ValueError, match="has no inner state"):
        dah.hooks.OuterOptimizerState(dah.hooks.PowerSGDState()).load_state_dict(saved)
