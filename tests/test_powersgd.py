"""PowerSGD on parameter deltas: exactness at full rank, bytes, agreement, edge cases.

Every expected value is computed here from the ranks' raw parameters (float64 means,
shapes), never from the hook's own output. Rounds are driven the way the registry
drives them (load every bucket, call the hook per bucket, wait, write back), so the
multi-bucket ordering of collectives is exercised too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import ParamBucket, assign_buckets
from ddp_avg_hooks.hooks import PowerSGDState, powersgd_hook
from ddp_avg_hooks.rounds import run_round

from _dist import run_ranks
from _helpers import flat as _flat

SHAPES = [(6, 4), (4, 3, 2, 2), (6,), (), (1, 5), (16, 12)]  # matrix, conv, bias, scalar, row, big
CAP_MB = 800 / 2**20  # -> buckets [(6,4) .. (1,5)] and [(16,12)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _round(state, buckets: list[ParamBucket]) -> int:
    """One averaging round, as the registry runs it; returns the bytes sent.

    Like the registry's buffer averaging (or training going on during an overlapped
    round), another collective is issued on the same group before the hooks' futures
    are waited for: the hooks' collectives must not interleave with it differently on
    different ranks.
    """
    other = torch.full((7,), float(dist.get_rank() + 1))
    futs = []
    issue_other = lambda: futs.append(dist.all_reduce(other, async_op=True).get_future())
    done = run_round(powersgd_hook, state, buckets, between=issue_other)
    ws = dist.get_world_size()
    assert torch.equal(futs[0].wait()[0], torch.full((7,), ws * (ws + 1) / 2))
    return done.bytes_sent


def _expected_bytes(rank: int, min_rate: float) -> int:
    """4 bytes x (r (n + m) per compressed n x m matrix + every other element)."""
    numbers = 0
    for shape in SHAPES:
        numel = math.prod(shape)
        if len(shape) >= 2:
            n, m = shape[0], numel // shape[0]
            r = min(rank, n, m)
            if r * (n + m) * min_rate < n * m:
                numbers += r * (n + m)
                continue
        numbers += numel
    return 4 * numbers


def _both_configs_on_ranks(rank, world_size):
    return {
        # full rank: 16 >= min(n, m) for every matrix, min_compression_rate=0 compresses all
        "full": _rounds_on_ranks(rank, approx_rank=16, min_rate=0.0, rounds=3, zero_first=True),
        "low": _rounds_on_ranks(rank, approx_rank=1, min_rate=2.0, rounds=3, zero_first=False),
    }


def _rounds_on_ranks(rank, *, approx_rank, min_rate, rounds, zero_first):
    """Run ``rounds`` rounds; return the pre/post parameters and the traffic per round."""
    torch.manual_seed(1234)  # must not matter: the hook may not use the global RNG
    rng_before = torch.get_rng_state()
    params = _params()
    buckets = assign_buckets(params, CAP_MB, keep_anchor=True)
    assert len(buckets) == 2
    state = PowerSGDState(matrix_approximation_rank=approx_rank, min_compression_rate=min_rate,
                          seed=7)
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    out = {"pre": [], "post": [], "bytes": [], "calls": []}
    try:
        for k in range(rounds):
            if not (zero_first and k == 0):
                g = torch.Generator().manual_seed(1000 * k + rank)
                with torch.no_grad():
                    for p in params:
                        p.add_(torch.randn(p.shape, generator=g), alpha=0.01 * (1 + rank))
            out["pre"].append(_flat(params))
            calls.clear()
            sent = _round(state, buckets)
            out["post"].append(_flat(params))
            out["bytes"].append(sent)
            out["calls"].append(len(calls))
    finally:
        dist.all_reduce = real_all_reduce
    out["rng_untouched"] = torch.equal(rng_before, torch.get_rng_state())
    out["round"] = state.round
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_full_rank_is_exact_and_low_rank_sends_r_n_plus_m(world_size):
    results = run_ranks(_both_configs_on_ranks, world_size, timeout_s=60)
    full = [r["full"] for r in results]
    for k in range(3):
        exact = torch.stack([r["pre"][k].double() for r in full]).mean(0)
        for r in full:
            assert torch.isfinite(r["post"][k]).all()
            torch.testing.assert_close(r["post"][k].double(), exact, rtol=1e-5, atol=2e-6)
            assert torch.equal(r["post"][k], full[0]["post"][k])  # bit-identical ranks
    # round 0 had an all-zero delta: nothing moved, and round 1 was still exact (Q re-drawn)
    assert torch.equal(full[0]["post"][0], full[0]["pre"][0])
    assert full[0]["bytes"][0] == _expected_bytes(16, 0.0)

    low = [r["low"] for r in results]
    for r in low:
        assert r["rng_untouched"] and r["round"] == 3
        assert r["bytes"] == [_expected_bytes(1, 2.0)] * 3
        assert all(c == 2 * 2 + 1 for c in r["calls"])  # two per bucket (+1: _round's own)
    for k in range(3):
        for r in low:
            assert torch.equal(r["post"][k], low[0]["post"][k])
        exact = torch.stack([r["pre"][k].double() for r in low]).mean(0)
        # exact tensors (bias, scalar, 1 x 5 row) are averaged exactly even at rank 1
        off = 6 * 4 + 4 * 12
        exact_slice = slice(off, off + 6 + 1 + 5)
        torch.testing.assert_close(low[0]["post"][k][exact_slice].double(), exact[exact_slice],
                                   rtol=1e-5, atol=2e-6)
    # 4 bytes x (10 + 16 + 6 + 1 + 5 + 28) numbers
    assert _expected_bytes(1, 2.0) == 4 * (1 * (6 + 4) + 1 * (4 + 12) + 6 + 1 + 5 + 1 * (16 + 12))


# --- single process (a world_size=1 gloo group): state, edge cases ---------------------------
def test_zero_delta_keeps_parameters_and_gives_no_nan(world1):
    for rank in (1, 3):
        params = _params()
        before = _flat(params)
        buckets = assign_buckets(params, CAP_MB, keep_anchor=True)
        state = PowerSGDState(matrix_approximation_rank=rank, min_compression_rate=0.0)
        for _ in range(2):
            _round(state, buckets)
            assert torch.equal(_flat(params), before)
        mem = state.memory_of(0)
        assert torch.isfinite(mem.p).all() and torch.isfinite(mem.q).all()


def test_conv_and_scalar_parameters(world1):
    # conv weight (4, 3, 2, 2) is compressed as a 4 x 12 matrix; the 0-dim one is exact.
    conv = torch.nn.Parameter(torch.randn(4, 3, 2, 2))
    scalar = torch.nn.Parameter(torch.tensor(2.5))
    bucket = ParamBucket(0, [conv, scalar], is_last=True, keep_anchor=True)
    state = PowerSGDState(matrix_approximation_rank=4, min_compression_rate=0.0)
    with torch.no_grad():
        conv.add_(0.1)
        scalar.add_(-0.25)
    target = (conv.detach().clone(), scalar.detach().clone())
    sent = _round(state, [bucket])  # one rank, full rank (4 = min(4, 12)): the "average" is itself
    assert conv.shape == (4, 3, 2, 2) and scalar.dim() == 0
    torch.testing.assert_close(conv.detach(), target[0], rtol=0, atol=1e-6)
    assert scalar.item() == 2.25
    assert sent == 4 * (4 * (4 + 12) + 1)
    assert state.memory_of(0).layout.matrices[0][1:4] == (4, 12, 4)


def test_state_dict_resumes_bit_for_bit(world1):
    def run(state, params, buckets, rounds, start):
        for k in range(start, start + rounds):
            g = torch.Generator().manual_seed(k)
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.shape, generator=g), alpha=0.01)
            _round(state, buckets)

    params = _params()
    buckets = assign_buckets(params, CAP_MB, keep_anchor=True)
    state = PowerSGDState(matrix_approximation_rank=2)
    run(state, params, buckets, 3, 0)
    saved, saved_params = state.state_dict(), _flat(params)
    saved_anchors = [b.anchor().clone() for b in buckets]
    assert saved["round"] == 3 and set(saved["buckets"]) == {0, 1}
    assert set(saved["buckets"][0]) == {"q", "residual"}
    run(state, params, buckets, 2, 3)
    reference = _flat(params)

    params2 = _params(seed=99)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(saved_params, params2)
    buckets2 = assign_buckets(params2, CAP_MB, keep_anchor=True)
    for b, a in zip(buckets2, saved_anchors):
        b.anchor().copy_(a)
    resumed = PowerSGDState(matrix_approximation_rank=2)
    resumed.load_state_dict(saved)  # before the first round: applied lazily
    run(resumed, params2, buckets2, 2, 3)
    assert torch.equal(_flat(params2), reference)


def test_low_rank_error_feedback_catches_up(world1):
    # One rank, rank 1, the same full-rank 8 x 8 change every round: without error
    # feedback the rank-1 projection loses part of it every round and the lag grows
    # linearly; with it, the lost part is sent in later rounds and the lag stays at a
    # few rounds' worth of change (measured: 3 to 5 step norms, flat from round 10 on).
    step = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)) * 0.01
    lag = {}
    for ef in (True, False):
        w = torch.nn.Parameter(torch.zeros(8, 8))
        bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
        state = PowerSGDState(matrix_approximation_rank=1, use_error_feedback=ef)
        lag[ef] = []
        for k in range(1, 81):
            with torch.no_grad():
                w.add_(step)
            _round(state, [bucket])
            lag[ef].append(float((w.detach() - k * step).norm() / step.norm()))
    assert max(lag[True]) < 8.0  # bounded
    assert max(lag[True][40:]) < 1.5 * max(lag[True][:40])  # not growing
    assert lag[False][-1] > 40.0 and lag[False][-1] > 1.8 * lag[False][39]  # grows linearly


def test_validation_messages():
    with pytest.raises(ValueError, match="orthogonalization_epsilon must be > 0"):
        PowerSGDState(orthogonalization_epsilon=0.0)
    with pytest.raises(ValueError, match="matrix_approximation_rank must be >= 1"):
        PowerSGDState(matrix_approximation_rank=0)
    with pytest.raises(TypeError, match="matrix_approximation_rank must be an int"):
        PowerSGDState(matrix_approximation_rank=2.0)
    with pytest.raises(ValueError, match="min_compression_rate must be finite and >= 0"):
        PowerSGDState(min_compression_rate=-1)
    with pytest.raises(TypeError, match="use_error_feedback must be True or False"):
        PowerSGDState(use_error_feedback=1)
    with pytest.raises(TypeError, match="process_group must be None"):
        PowerSGDState(process_group="world")
    with pytest.raises(TypeError, match="powersgd_hook: state must be a PowerSGDState"):
        dah.hook_spec(powersgd_hook).validate(None)


def test_state_pickles_without_its_process_group():
    import pickle

    state = PowerSGDState(matrix_approximation_rank=3, seed=5)
    copy = pickle.loads(pickle.dumps(state))
    assert (copy.matrix_approximation_rank, copy.seed, copy.process_group) == (3, 5, None)
