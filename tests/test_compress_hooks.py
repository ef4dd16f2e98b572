"""fp16/bf16 delta hooks: small updates survive, error feedback, and training parity.

Expected values are computed here from the ranks' raw parameters (float64 means) or
from the updates the test applied, never from the hooks' output. The training test
also covers ``powersgd_hook`` (one set of spawned ranks for all hooks).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import ParamBucket
from ddp_avg_hooks.hooks import HalfDeltaState, bf16_compress_hook, fp16_compress_hook

from ddp_avg_hooks.rounds import run_round as _round
from _dist import run_ranks
from _helpers import flat as _flat


def _half_params_hook(state, bucket):
    """The trap the delta hooks avoid: average the *parameters* in fp16 (DDP's fp16 hook)."""
    ws = dist.get_world_size()
    half = bucket.buffer().div(ws).to(torch.float16)
    fut = dist.all_reduce(half, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].to(bucket.dtype))


# --- small updates at magnitude 20 ----------------------------------------------------------
def _survive_on_ranks(rank, world_size):
    """fp32 parameters near 20; per-rank updates ~1e-3 (fp16 spacing at 20: 0.0156)."""
    out = {}
    variants = {
        "fp16": (fp16_compress_hook, None),
        "bf16": (bf16_compress_hook, HalfDeltaState()),
        "half_params": (_half_params_hook, None),
    }
    for name, (hook, state) in variants.items():
        g0 = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(20 + 0.5 * torch.rand(s, generator=g0))
                  for s in [(8, 8), (64,)]]
        bucket = ParamBucket(0, params, is_last=True, keep_anchor=True)
        init, pre, post = _flat(params), [], []
        for k in range(4):
            g = torch.Generator().manual_seed(100 * k + rank)
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=g), alpha=1e-3 * (1 + rank))
            pre.append(_flat(params))
            _round(hook, state, [bucket])
            post.append(_flat(params))
        out[name] = {"init": init, "pre": pre, "post": post}
    return out


@pytest.mark.parametrize("world_size", [3])  # 2 ranks: the drift and training tests
def test_updates_far_below_half_spacing_survive(world_size):
    results = run_ranks(_survive_on_ranks, world_size, timeout_s=60)
    worst = {}
    for name in ("fp16", "bf16", "half_params"):
        worst[name] = 0.0
        start = results[0][name]["init"].double()
        for k in range(4):
            exact = torch.stack([r[name]["pre"][k].double() for r in results]).mean(0)
            post = results[0][name]["post"][k]
            for r in results:
                assert torch.equal(r[name]["post"][k], post)  # bit-identical ranks
            err = (post.double() - exact).abs().max() / (exact - start).abs().max()
            worst[name] = max(worst[name], float(err))
            start = post.double()
    # The mean update per round is ~1e-3: far below fp16 (0.0156) and bf16 (0.125)
    # spacing at 20. The delta hooks keep it to within a small fraction (fp16: fp32
    # rounding of the parameters dominates, ~1e-3; bf16: 2**-8 of the delta)...
    assert worst["fp16"] < 0.005, worst
    assert worst["bf16"] < 0.02, worst
    # ...while rounding the parameters themselves to fp16 loses the update entirely.
    assert worst["half_params"] > 0.5, worst


# --- long-run drift, error feedback ----------------------------------------------------------
# float64 parameters, so that only the compression error shows, and the same update
# every round (a persistent direction), so that a repeated rounding error adds up
# linearly. Cases, per rank r:
#   one_rank: only rank 0 moves. The allreduce's fp16 sum (h_0 + 0) is then exact, so
#             this isolates each rank's own rounding, which error feedback controls.
#   tiny:     1e-8 * (1 + r): half of it is below fp16's smallest subnormal (2**-24).
#   both:     normal updates on every rank: the fp16 sum inside the allreduce rounds too.
def _drift_on_ranks(rank, world_size, rounds):
    g = torch.Generator().manual_seed(10 + rank)
    normal = torch.randn(256, generator=g, dtype=torch.float64) * 3e-3 * (1 + rank)
    updates = {
        "one_rank": normal if rank == 0 else torch.zeros(256, dtype=torch.float64),
        "tiny": torch.full((256,), 1e-8 * (1 + rank), dtype=torch.float64),
        "both": normal,
    }
    out = {"updates": updates}
    for name, update in updates.items():
        for ef in (True, False, "wide"):  # "wide": error feedback, a float64 residual
            w = torch.nn.Parameter(torch.full((256,), 20.0, dtype=torch.float64))
            bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
            state = (HalfDeltaState(residual_dtype=None) if ef == "wide"
                     else HalfDeltaState(error_feedback=ef))
            history = []
            for k in range(1, rounds + 1):
                with torch.no_grad():
                    w.add_(update)
                _round(fp16_compress_hook, state, [bucket])
                if k in (rounds // 2, rounds):
                    history.append(w.detach().clone())
            out[(name, ef)] = history
    return out


@pytest.mark.slow
def test_error_feedback_bounds_long_run_drift():
    rounds, ws, u = 200, 2, 2.0**-11  # u: fp16 unit roundoff
    results = run_ranks(_drift_on_ranks, ws, timeout_s=60, rounds=rounds)
    for key in results[0]:
        if key != "updates":
            for a, b in zip(results[0][key], results[1][key]):
                assert torch.equal(a, b)  # bit-identical ranks

    def drift(name, ef, when):  # max |params - exact trajectory| after `when` rounds
        step = sum(r["updates"][name] for r in results)  # exact mean update x ws ... / ws below
        exact = 20.0 + when * step / ws
        return (results[0][(name, ef)][0 if when == rounds // 2 else 1] - exact).abs()

    # one_rank: with error feedback in full precision the drift is at most one rounding
    # of one round's delta and does not grow; with the default bfloat16 residual, at
    # most (1 + rounds * 2**-8) of that; without it the same error repeats every round.
    step = results[0]["updates"]["one_rank"].abs() / ws
    one = u * 1.01 * step + 2.0**-25  # one rounding of a round's delta (and residual)
    for when in (rounds // 2, rounds):
        assert (drift("one_rank", "wide", when) <= u * step + 2.0**-25).all()
        assert (drift("one_rank", True, when) <= (1 + when * 2.0**-8) * one).all()
    d_full = drift("one_rank", True, rounds)
    no_ef = drift("one_rank", False, rounds)
    assert no_ef.max() > 1.8 * drift("one_rank", False, rounds // 2).max()  # linear growth
    assert no_ef.max() > 50 * d_full.max()
    # tiny: without error feedback nothing ever moves; with it the parameters lag by
    # less than one fp16 subnormal step per rank.
    assert torch.equal(results[0][("tiny", False)][1],
                       torch.full((256,), 20.0, dtype=torch.float64))
    assert drift("tiny", True, rounds).max() <= ws * 2.0**-24
    # both: the allreduce's own fp16 sum rounds (ws - 1 times per element and round) and
    # no rank can see that error to feed it back. The documented bound: at most
    # rounds * (ws - 1) * (u |mean step| + 2**-25) plus one round's residuals.
    mean_step = sum(r["updates"]["both"] for r in results).abs() / ws
    bound = rounds * (ws - 1) * (u * 1.01 * mean_step + 2.0**-25) + ws * (u * mean_step + 2.0**-25)
    assert (drift("both", True, rounds) <= bound).all()


# --- training parity -------------------------------------------------------------------------
def _train_on_ranks(rank, world_size, steps, period):
    """Train the same MLP with each hook; seeds: model 0, teacher 42, data 100 + rank, eval 7."""
    torch.manual_seed(42)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(7)
    x_eval = torch.randn(512, 16, generator=g)
    with torch.no_grad():
        y_eval = teacher(x_eval)
    setups = {
        "allreduce": (dah.hooks.allreduce_hook, lambda: None),
        "fp16": (dah.hooks.fp16_compress_hook, lambda: None),
        "powersgd": (dah.hooks.powersgd_hook,
                     lambda: dah.hooks.PowerSGDState(matrix_approximation_rank=4, seed=0)),
    }
    losses = {}
    for name, (hook, make_state) in setups.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                    torch.nn.Linear(64, 4))
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        handle = dah.register_averaging_hook(ddp, hook, make_state(), period=period, optimizer=opt)
        ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
        data = torch.Generator().manual_seed(100 + rank)
        curve = []
        for _ in range(steps):
            x = torch.randn(32, 16, generator=data)
            with torch.no_grad():
                y = teacher(x)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()  # averages after steps 0, 8, 16, ... (step post-hook)
            if handle.step_count % period == 1:  # just averaged: ranks agree
                with torch.no_grad():
                    curve.append(float(torch.nn.functional.mse_loss(model(x_eval), y_eval)))
        losses[name] = curve
        handle.remove()
    return losses


def test_training_loss_matches_allreduce_hook():
    steps, period = 161, 8  # the last step averages: 21 rounds
    results = run_ranks(_train_on_ranks, 2, timeout_s=90, steps=steps, period=period)
    for r in results:
        assert r == results[0]  # evaluated right after a round: every rank holds the same model
    losses = results[0]
    ref = losses["allreduce"]
    assert ref[-1] < 0.5 * ref[0]  # it learns
    for name, tol in (("fp16", 0.005), ("powersgd", 0.02)):
        # Relative gap of the eval loss right after each of the last 6 rounds (steps
        # 120..160). Measured: fp16 < 1e-4 at every round; PowerSGD up to 15% in the
        # early rounds (rounds 2..8), then under 1% from round 13 on.
        gaps = [abs(a - b) / b for a, b in zip(losses[name][-6:], ref[-6:])]
        assert max(gaps) < tol, (name, gaps, losses[name][-3:], ref[-3:])


# --- single process (a world_size=1 gloo group) ----------------------------------------------
@pytest.mark.parametrize("hook", [fp16_compress_hook, bf16_compress_hook])
def test_zero_delta_leaves_parameters_unchanged(world1, hook):
    w = torch.nn.Parameter(torch.full((5, 3), 20.0) + torch.rand(5, 3))
    before = w.detach().clone()
    bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
    for state in (None, HalfDeltaState()):
        assert _round(hook, state, [bucket]).bytes_sent == 2 * 15  # 2 bytes per element
        assert torch.equal(w.detach(), before)


def test_state_dict_resumes_bit_for_bit(world1):
    def run(w, bucket, state, ks):
        for k in ks:
            with torch.no_grad():
                w.add_(torch.randn(w.shape, generator=torch.Generator().manual_seed(k)), alpha=1e-3)
            _round(bf16_compress_hook, state, [bucket])

    w = torch.nn.Parameter(torch.full((64,), 3.0))
    bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
    state = HalfDeltaState()
    run(w, bucket, state, range(3))
    saved, saved_w = state.state_dict(), w.detach().clone()
    assert saved["residuals"][0].abs().max() > 0  # bf16 rounding left something to carry
    run(w, bucket, state, range(3, 6))

    w2 = torch.nn.Parameter(saved_w.clone())
    bucket2 = ParamBucket(0, [w2], is_last=True, keep_anchor=True)
    resumed = HalfDeltaState()
    resumed.load_state_dict(saved)
    run(w2, bucket2, resumed, range(3, 6))
    assert torch.equal(w2.detach(), w.detach())


def test_plain_group_state_keeps_error_feedback_in_bucket_memory(world1):
    # state None: error feedback is on, with the residual in bucket.memory(), which the
    # handle checkpoints (tests/test_reliability.py resumes it bit for bit).
    w = torch.nn.Parameter(torch.full((16,), 3.0))
    bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
    with torch.no_grad():
        w.add_(1e-3)
    _round(bf16_compress_hook, None, [bucket])
    residual = bucket.memory()["half_residual"]
    assert residual.abs().max() > 0
    # exact: anchor - bf16(delta) + residual == params before the round
    torch.testing.assert_close(w.detach() - residual, torch.full((16,), 3.001), rtol=0, atol=1e-6)
    # the send buffer is the bucket's own scratch: nothing else keeps the bucket alive
    alive = weakref.ref(bucket)
    del bucket
    gc.collect()
    assert alive() is None


def test_validation_messages():
    with pytest.raises(TypeError,
                       match="fp16_compress_hook: state must be None .* or a HalfDeltaState"):
        dah.hook_spec(fp16_compress_hook).validate(3)
    with pytest.raises(TypeError, match="error_feedback must be True or False"):
        HalfDeltaState(error_feedback=1)
    with pytest.raises(TypeError, match="process_group must be None"):
        HalfDeltaState(process_group="world")
    dah.hook_spec(fp16_compress_hook).validate(None)
    dah.hook_spec(bf16_compress_hook).validate(HalfDeltaState())
    assert dah.hook_spec(fp16_compress_hook).needs_anchor
    assert dah.hook_spec(bf16_compress_hook).needs_anchor


@pytest.mark.parametrize("which", ["fp16", "powersgd"])
def test_handle_checkpoint_resumes_bit_for_bit(world1, which):
    # Through the registry: handle.state_dict() carries the hook state (residuals, Q).
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        state = (HalfDeltaState() if which == "fp16"
                 else dah.hooks.PowerSGDState(matrix_approximation_rank=2))
        hook = fp16_compress_hook if which == "fp16" else dah.hooks.powersgd_hook
        handle = dah.register_averaging_hook(ddp, hook, state, period=2, optimizer=opt)
        return model, ddp, opt, handle

    def train(ddp, opt, steps):
        for k in steps:
            g = torch.Generator().manual_seed(k)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

    model, ddp, opt, handle = make()
    train(ddp, opt, range(5))
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict(), "avg": handle.state_dict()}
    train(ddp, opt, range(5, 11))
    reference = [p.detach().clone() for p in model.parameters()]
    handle.remove()

    model2, ddp2, opt2, handle2 = make()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    handle2.load_state_dict(saved["avg"])
    train(ddp2, opt2, range(5, 11))
    for a, b in zip(model2.parameters(), reference):
        assert torch.equal(a.detach(), b)
    handle2.remove()
