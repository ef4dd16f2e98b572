"""int8/int4 delta hooks against a numpy reference: bits, bytes vs world size, error bounds,
error feedback over every rounding, checkpoints, registration with and without overlap.

The reference (``_np_round``) is a single-process numpy computation of the blockwise
scheme the hooks' docstring states, written from that description; expected averages
are float64 means of the ranks' raw parameters. Two spawned jobs: four ranks (groups of
2, 3 and 4 ranks: one all-gather, and all-to-all with requantization) and two ranks
(long runs, DDP registrations).
"""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import ParamBucket
from ddp_avg_hooks.hooks import (QuantizedDeltaState, int2_compress_hook, int4_compress_hook,
                                 int8_compress_hook)
from ddp_avg_hooks.rounds import run_round

from _dist import run_ranks
from _helpers import flat as _flat

# module-scoped runs serve several tests: one worker runs them all, early
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_quantized_hooks")]

HOOKS = {8: int8_compress_hook, 4: int4_compress_hook, 2: int2_compress_hook}
QMAX = {8: 127, 4: 7, 2: None}
K_SLACK = 1 + 2.0**-14  # the docstring's k
BLOCK = 32


# --- the reference ---------------------------------------------------------------------------
def _np_rms_scale(vb: np.ndarray, amax: np.ndarray) -> np.ndarray:
    """The 2-bit codes' scale of each row: its root mean square from the fixed-point sum
    of squares the docs state, ``amax * sqrt(sum floor((v / amax)^2 * 2^24) / (2^24 n))``."""
    a = np.where(amax == 0, np.ones_like(amax), amax)[:, None]
    t = vb / a
    k = np.floor(t * t * vb.dtype.type(2.0**24)).astype(np.int64).sum(axis=1)
    return (amax.astype(np.float64) * np.sqrt(k / (2.0**24 * vb.shape[1]))).astype(np.float32)


def _np_quant(v: np.ndarray, block: int, qmax: int):
    """Blockwise round-to-nearest of ``v`` (a multiple of ``block`` long) under the block
    maximum over ``qmax``: the dequantized values and each block's scale (as float32).
    ``qmax=None``: the 2-bit codes' four levels, +-0.5 and +-1.5 times the block's root
    mean square, the values above 2 of it clipped."""
    vb = v.reshape(-1, block)
    amax = np.abs(vb).max(axis=1)
    if qmax is None:
        scale = _np_rms_scale(vb, amax)
    elif v.dtype == np.float32:
        scale = amax * np.float32(1.0 / qmax)
    else:
        scale = (amax * (1.0 / qmax)).astype(np.float32)
    s = scale.astype(v.dtype)[:, None]
    d = np.where(s == 0, np.ones_like(s), s)
    if qmax is None:
        q = np.clip(np.floor(vb / d) + 0.5, -1.5, 1.5)
    else:
        q = np.clip(np.rint(vb / d), -qmax, qmax)
    return (q * s).reshape(-1), scale


def _np_round(anchor, params, residuals, bits, block=BLOCK, ef=True):
    """One round over one bucket: the new parameters; ``residuals`` updated in place."""
    n, numel, dt = len(params), anchor.size, anchor.dtype
    gathered = n <= 2  # every rank's codes to every rank, summed there: no requantization
    piece = max(1, math.ceil(numel / ((1 if gathered else n) * block))) * block
    qmax = QMAX[bits]
    dq = []
    for r in range(n):
        v = np.zeros(piece if gathered else n * piece, dtype=dt)
        v[:numel] = (anchor - params[r]) * dt.type(1.0 / n)
        if ef:
            v[:numel] += residuals[r]
        d, _ = _np_quant(v, block, qmax)
        if ef:
            residuals[r][:] = v[:numel] - d[:numel]
        d[numel:] = 0  # the padding is never read back (2-bit codes decode it to 0.5 scale)
        dq.append(d)
    if gathered:
        total = dq[0].copy()
        for r in range(1, n):
            total = total + dq[r]
        return anchor - total[:numel]
    reduced = np.zeros(n * piece, dtype=dt)
    for j in range(n):
        sl = slice(j * piece, (j + 1) * piece)
        total = dq[0][sl].copy()
        for r in range(1, n):
            total = total + dq[r][sl]
        reduced[sl], _ = _np_quant(total, block, qmax)
        end = min((j + 1) * piece, numel)
        if ef and j * piece < numel:
            residuals[j][j * piece : end] += (total - reduced[sl])[: end - j * piece]
    return anchor - reduced[:numel]


def _np_round_bound(anchor, params, residuals, bits, block=BLOCK):
    """The docstring's per-element bound for one round, given the residuals before it."""
    n, numel, dt = len(params), anchor.size, np.float64
    piece = max(1, math.ceil(numel / (n * block))) * block
    pad = n * piece - numel
    # one rounding of a block whose largest |value| is a: a / (2 Q); 2-bit codes: a (a
    # clipped value), so at most a
    share = 1.0 if bits == 2 else 1.0 / (2 * QMAX[bits])
    vs = [np.pad((anchor - p).astype(dt) / n + e, (0, pad)) for p, e in zip(params, residuals)]
    a = [np.repeat(np.abs(v).reshape(-1, block).max(1), block) for v in vs]
    total = np.abs(sum(vs)) + 2 * share * sum(a)  # |T| <= |sum v| + sum of own roundings
    # the requantization's term, from three ranks on
    big_a = np.repeat(total.reshape(-1, block).max(1), block) if n > 2 else 0.0
    return (K_SLACK * (sum(a) + big_a) * share * (1 + 1e-6))[:numel]


def _expected_bytes(numel: int, bits: int, block: int = BLOCK) -> int:
    return math.ceil(numel * bits / 8) + 4 * math.ceil(numel / block)


# --- spying on the collectives ---------------------------------------------------------------
class _Spy:
    """Record (name, input bytes, thread) of each collective the hooks and the test issue."""

    NAMES = {"all_to_all_single": 1, "all_gather_single": 1, "all_gather_into_tensor": 1,
             "all_reduce": 0}

    def __init__(self):
        self.calls, self._orig = [], {}

    def __enter__(self):
        for name, arg in self.NAMES.items():
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._orig[name] = fn

            def wrapper(*args, _fn=fn, _name=name, _arg=arg, **kw):
                t = args[_arg]
                self.calls.append((_name, t.numel() * t.element_size(), threading.get_ident()))
                return _fn(*args, **kw)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(dist, name, fn)


# --- four ranks: groups of 2, 3 and 4 ----------------------------------------------------------
SHAPES = [(64, 63), (90,), (10,), (33,)]  # buckets: [0, 1], [2], [3]
ROUNDS = 4  # round 0 moves nothing


def _buckets(params):
    return [ParamBucket(0, params[:2], is_last=False, keep_anchor=True),
            ParamBucket(1, params[2:3], is_last=False, keep_anchor=True),
            ParamBucket(2, params[3:], is_last=True, keep_anchor=True)]


def _rounds_in_group(rank, group, bits):
    g0 = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(1 + torch.rand(s, generator=g0)) for s in SHAPES]
    buckets = _buckets(params)
    state = QuantizedDeltaState(block_size=BLOCK, process_group=group)
    out = {"init": _flat(params), "pre": [], "post": [], "bytes": [], "calls": [],
           "main": threading.get_ident()}
    other = torch.ones(3)
    for k in range(ROUNDS):
        if k:
            g = torch.Generator().manual_seed(100 * k + rank)
            with torch.no_grad():
                for i, p in enumerate(params):
                    if i != 1:  # the (90,) parameter never moves: all-zero blocks
                        p.add_(torch.randn(p.shape, generator=g), alpha=1e-2 * (1 + rank))
        out["pre"].append(_flat(params))
        with _Spy() as spy:
            done = run_round(HOOKS[bits], state, buckets,
                             between=lambda: dist.all_reduce(other, group=group))
        out["post"].append(_flat(params))
        out["bytes"].append(done.bytes_sent)
        out["calls"].append(spy.calls)
    out["other"] = other
    out["residuals"] = {i: r.clone() for i, r in state.state_dict()["residuals"].items()}
    return out


def _four_ranks(rank, world_size):
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]), 4: dist.group.WORLD}
    return {(g, bits): _rounds_in_group(rank, group, bits)
            for g, group in groups.items() for bits in (8, 4, 2) if rank < g}


@pytest.fixture(scope="session")
def four():
    return run_ranks(_four_ranks, 4, timeout_s=120)


def _bucket_slices():
    sizes = [math.prod(s) for s in SHAPES]
    ends = np.cumsum([sizes[0] + sizes[1], sizes[2], sizes[3]])
    return [slice(int(e - n), int(e))
            for e, n in zip(ends, [sizes[0] + sizes[1], sizes[2], sizes[3]])]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("g", [2, 3, 4])
def test_rounds_match_numpy_reference_bit_for_bit(four, g, bits):
    ranks = [four[r][(g, bits)] for r in range(g)]
    for k in range(ROUNDS):
        for r in ranks:
            assert torch.equal(r["post"][k], ranks[0]["post"][k])  # bit-identical ranks
    residuals = {i: [np.zeros(s.stop - s.start, np.float32) for _ in range(g)]
                 for i, s in enumerate(_bucket_slices())}
    anchor = ranks[0]["init"].numpy()
    for k in range(ROUNDS):
        for i, sl in enumerate(_bucket_slices()):
            pre = [r["pre"][k].numpy()[sl] for r in ranks]
            expected = _np_round(anchor[sl], pre, residuals[i], bits)
            got = ranks[0]["post"][k].numpy()[sl]
            assert np.array_equal(got.view(np.int32), expected.view(np.int32)), (k, i)
        anchor = ranks[0]["post"][k].numpy()
        assert np.isfinite(anchor).all()
    for r in range(g):  # the residuals agree too, rank by rank
        for i in residuals:
            assert np.array_equal(ranks[r]["residuals"][i].numpy(), residuals[i][r])


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_zero_delta_leaves_parameters_unchanged(four, bits):
    for g in (2, 3, 4):
        for r in range(g):
            res = four[r][(g, bits)]
            assert torch.equal(res["post"][0], res["init"])  # round 0: no update anywhere
    # the never-moving (90,) parameter sits in all-zero blocks: it stays finite and exact
    sl = slice(64 * 63 + 40, 64 * 63 + 90)
    res = four[0][(2, bits)]
    assert torch.isfinite(res["post"][-1]).all()
    assert (res["post"][-1][sl] - res["init"][sl]).abs().max() < 1e-6


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_bytes_do_not_grow_with_world_size(four, bits):
    sizes = [s.stop - s.start for s in _bucket_slices()]
    expected = sum(_expected_bytes(n, bits) for n in sizes)
    handed = {}
    for g in (2, 3, 4):
        for r in range(g):
            res = four[r][(g, bits)]
            assert res["bytes"] == [expected] * ROUNDS  # recorded: codes + scales, any world size
            calls = res["calls"][1]
            a2a = [c[1] for c in calls if c[0] == "all_to_all_single"]
            gather = [c[1] for c in calls if c[0].startswith("all_gather")]
            assert len(gather) == 3
            if g == 2:  # one all-gather of the whole payload, zero-padded to < BLOCK values more
                assert a2a == []
                for n, sent in zip(sizes, gather):
                    assert _expected_bytes(n, bits) <= sent <= _expected_bytes(n + BLOCK, bits) + 4
                handed[g] = gather[0]
                continue
            assert len(a2a) == 3
            for n, sent, piece in zip(sizes, a2a, gather):
                # the whole payload once (zero-padded to < g * BLOCK values more), and one
                # piece of it, 1/g, in the all-gather: never g payloads
                assert sent == g * piece
                padded = _expected_bytes(n + g * BLOCK, bits) + 4 * g
                assert _expected_bytes(n, bits) <= sent <= padded
            handed[g] = a2a[0] + gather[0]
    # the large bucket (4122 values): two ranks hand over one payload each; from three on
    # what a rank hands over, (1 + 1/g) payloads, shrinks towards one payload
    assert handed[2] <= handed[4] <= handed[3] <= handed[2] * (1 + 1 / 3) * 1.02
    ratio = expected / (4 * sum(sizes))
    assert ratio < {8: 0.29, 4: 0.16, 2: 0.1}[bits], ratio


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_collectives_issued_in_order_by_the_calling_thread(four, bits):
    # from three ranks on the hooks issue the all-to-alls; the second phases, deferred
    # until every bucket's is in flight, the all-gathers; then the collective issued
    # between launch and wait. Two ranks: one all-gather per bucket.
    for g in (2, 3, 4):
        first = ["all_gather"] * 3 if g == 2 else ["all_to_all_single"] * 3 + ["all_gather"] * 3
        order = first + ["all_reduce"]
        seqs = []
        for r in range(g):
            res = four[r][(g, bits)]
            for calls in res["calls"]:
                assert [c[0].replace("_single", "").replace("_into_tensor", "")
                        if c[0].startswith("all_gather") else c[0] for c in calls] == order
                assert {c[2] for c in calls} == {res["main"]}
            seqs.append([[c[:2] for c in calls] for calls in res["calls"]])
            assert torch.equal(res["other"], torch.full((3,), float(g**ROUNDS)))
        assert all(s == seqs[0] for s in seqs)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_one_round_within_stated_bound(four, bits):
    for g in (2, 3, 4):
        ranks = [four[r][(g, bits)] for r in range(g)]
        anchor = ranks[0]["post"][0].double().numpy()  # round 1 starts with zero residuals
        pre = [r["pre"][1].double().numpy() for r in ranks]
        got = ranks[0]["post"][1].double().numpy()
        exact = np.mean(pre, axis=0)
        for sl in _bucket_slices():
            bound = _np_round_bound(anchor[sl], [p[sl] for p in pre],
                                    [np.zeros(sl.stop - sl.start)] * g, bits)
            err = np.abs(got[sl] - exact[sl])
            fp32 = (2.0**-23 * np.abs(exact[sl])
                    + 1e-6 * (1 + 4.0 * g) * np.abs(anchor[sl] - exact[sl]))
            assert (err <= bound + fp32).all(), (g, float((err - bound).max()))
            assert err.max() > 0.05 * bound.max()  # and the bound is not vacuous


# --- two ranks: long runs, registrations, checkpoints -----------------------------------------
LONG = 60


def _long_runs(rank):
    """float64 parameters (only the quantization shows) and the same update every round."""
    g = torch.Generator().manual_seed(10 + rank)
    normal = torch.randn(256, generator=g, dtype=torch.float64) * 3e-3 * (1 + rank)
    updates = {"one_rank": normal if rank == 0 else torch.zeros(256, dtype=torch.float64),
               "both": normal}
    out = {"updates": updates}
    for name, update in updates.items():
        for bits in (8, 4, 2):
            for ef in (True, False):
                w = torch.nn.Parameter(torch.full((256,), 2.0, dtype=torch.float64))
                bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
                state = QuantizedDeltaState(block_size=BLOCK, error_feedback=ef)
                hist = {}
                for k in range(1, LONG + 1):
                    with torch.no_grad():
                        w.add_(update)
                    run_round(HOOKS[bits], state, [bucket])
                    if k in (LONG // 2, LONG):
                        res = state.state_dict()["residuals"]
                        hist[k] = (w.detach().clone(), res[0].clone() if res else None)
                out[(name, bits, ef)] = hist
    return out


def _ddp_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))


def _train(ddp, opt, rank, steps):
    for k in steps:
        g = torch.Generator().manual_seed(1000 * rank + k)
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 3, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _same_on_ranks(t: torch.Tensor) -> bool:
    got = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(got, t.contiguous())
    return all(torch.equal(got[0], x) for x in got)


def _checkpoints(rank, bits, make_state):
    def make():
        model = _ddp_model()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        handle = dah.register_averaging_hook(ddp, HOOKS[bits], make_state(), period=2,
                                             optimizer=opt, bucket_cap_mb=5e-4)
        ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
        return model, ddp, opt, handle

    model, ddp, opt, handle = make()
    assert len(handle.buckets) >= 3  # several buckets, each with two collectives
    _train(ddp, opt, rank, range(5))
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict(), "avg": handle.state_dict()}
    _train(ddp, opt, rank, range(5, 11))  # the last step averages
    reference = _flat(model)
    same = _same_on_ranks(reference)
    handle.remove()
    model2, ddp2, opt2, handle2 = make()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    handle2.load_state_dict(saved["avg"])
    _train(ddp2, opt2, rank, range(5, 11))
    resumed = torch.equal(_flat(model2), reference)
    handle2.remove()
    return {"same": same, "resumed": resumed, "saved": saved["avg"]}


def _overlap(rank, bits):
    model = _ddp_model(1)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    handle = dah.register_averaging_hook(ddp, HOOKS[bits], None, period=2, optimizer=opt,
                                         overlap=True, bucket_cap_mb=5e-4)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    _train(ddp, opt, rank, range(9))
    handle.synchronize()
    anchors = all(_same_on_ranks(b.anchor()) for b in handle.buckets)
    rounds, finite = handle.stats.rounds, bool(torch.isfinite(_flat(model)).all())
    scratch = handle.memory_bytes()["scratch"].get("cpu", 0)
    handle.remove()
    return {"anchors": anchors, "rounds": rounds, "finite": finite, "scratch": scratch}


def _bf16_round(rank):
    g = torch.Generator().manual_seed(rank)
    w = torch.nn.Parameter(torch.full((300,), 3.0, dtype=torch.bfloat16))
    bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
    with torch.no_grad():
        w.add_(torch.randn(300, generator=g).mul_(0.1).bfloat16())
    pre = w.detach().clone()
    run_round(int8_compress_hook, None, [bucket])
    return {"pre": pre, "post": w.detach().clone()}


def _two_ranks(rank, world_size):
    return {"long": _long_runs(rank), "bf16": _bf16_round(rank),
            ("ckpt_none", 8): _checkpoints(rank, 8, lambda: None),
            ("ckpt_state", 4): _checkpoints(rank, 4, lambda: QuantizedDeltaState(block_size=16)),
            ("ckpt_state", 2): _checkpoints(rank, 2, lambda: QuantizedDeltaState(block_size=16)),
            ("overlap", 8): _overlap(rank, 8)}


@pytest.fixture(scope="session")
def two():
    return run_ranks(_two_ranks, 2, timeout_s=120)


def _simulate(updates, bits, ef, rounds):
    """The reference run of ``_long_runs``: parameters and residuals after each round."""
    p = np.full(256, 2.0)
    res = [np.zeros(256), np.zeros(256)]
    hist = {}
    for k in range(1, rounds + 1):
        pre = [p + u for u in updates]
        before = [r.copy() for r in res]
        p = _np_round(p, pre, res, bits, ef=ef)
        if k in (rounds // 2, rounds):
            hist[k] = (p.copy(), [r.copy() for r in res], before)
    return hist


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("name", ["one_rank", "both"])
def test_error_feedback_keeps_the_roundings(two, name, bits):
    # two ranks: each rank's own rounding (the requantization's, from three ranks on, is
    # checked residual by residual against the reference in the four-rank tests)
    updates = [r["long"]["updates"][name].numpy() for r in two]
    mean = sum(updates) / 2
    exact = {k: 2.0 + k * mean for k in (LONG // 2, LONG)}
    ref = {ef: _simulate(updates, bits, ef, LONG) for ef in (True, False)}
    drift = {}
    for ef in (True, False):
        for k in (LONG // 2, LONG):
            w0, w1 = (r["long"][(name, bits, ef)][k][0].numpy() for r in two)
            assert np.array_equal(w0, w1)
            assert np.array_equal(w0, ref[ef][k][0])  # the reference, bit for bit
            drift[ef, k] = np.abs(w0 - exact[k])
    # with error feedback: params = exact trajectory + the ranks' residuals, whatever the round
    for k in (LONG // 2, LONG):
        res = [r["long"][(name, bits, True)][k][1].numpy() for r in two]
        w = two[0]["long"][(name, bits, True)][k][0].numpy()
        np.testing.assert_allclose(w - exact[k], sum(res), rtol=0, atol=1e-12)
        # within the bound of the last round alone (its residuals before it: the reference's)
        bound = _np_round_bound(np.zeros(256), updates, ref[True][k][2], bits)
        assert (drift[True, k] <= bound).all()
    # without it the same rounding repeats every round: linear growth
    assert drift[False, LONG].max() > 1.9 * drift[False, LONG // 2].max()
    # (one 2-bit rounding is coarse: its residual, the drift with feedback, is larger)
    assert drift[False, LONG].max() > (8 if bits == 2 else 20) * drift[True, LONG].max()


def test_bf16_bucket(two):
    pre = torch.stack([r["bf16"]["pre"].double() for r in two])
    post = two[0]["bf16"]["post"]
    assert torch.equal(post, two[1]["bf16"]["post"]) and post.dtype == torch.bfloat16
    # int8 delta error (<= 0.6 / 254 of the block max) plus bf16 rounding of the parameters
    err = (post.double() - pre.mean(0)).abs()
    assert err.max() <= 0.35 / 127 + 2.0**-8 * 3.2


@pytest.mark.parametrize("kind,bits", [("ckpt_none", 8), ("ckpt_state", 4), ("ckpt_state", 2)])
def test_handle_checkpoint_resumes_bit_for_bit(two, kind, bits):
    for r in two:
        assert r[(kind, bits)]["same"] and r[(kind, bits)]["resumed"]
    saved = two[0][(kind, bits)]["saved"]
    if kind == "ckpt_none":  # the residual lives in bucket.memory(), which the handle saves
        residuals = [m["quant_residual"] for m in saved["bucket_memory"]]
    else:
        residuals = list(saved["hook_state"]["residuals"].values())
    assert residuals and any(float(t.abs().max()) > 0 for t in residuals)


def test_registration_with_overlap(two):
    for r in two:
        res = r[("overlap", 8)]
        assert res["anchors"] and res["finite"] and res["rounds"] == 5 and res["scratch"] > 0


# --- one process -------------------------------------------------------------------------------
def test_validation_messages():
    with pytest.raises(TypeError,
                       match="int8_compress_hook: state must be None .* or a QuantizedDeltaState"):
        dah.hook_spec(int8_compress_hook).validate(3)
    with pytest.raises(TypeError, match="int4_compress_hook: state must be None"):
        dah.hook_spec(int4_compress_hook).validate("x")
    with pytest.raises(TypeError, match="error_feedback must be True or False"):
        QuantizedDeltaState(error_feedback=1)
    with pytest.raises(TypeError, match="block_size must be an int"):
        QuantizedDeltaState(block_size=64.0)
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        QuantizedDeltaState(block_size=0)
    with pytest.raises(TypeError, match="process_group must be None"):
        QuantizedDeltaState(process_group="world")
    with pytest.raises(ValueError, match="int2_compress_hook: block_size must be a multiple of 4"
                                         ".* got 6; try 64 or 128"):
        dah.hook_spec(int2_compress_hook).validate(QuantizedDeltaState(block_size=6))
    dah.hook_spec(int8_compress_hook).validate(None)
    dah.hook_spec(int4_compress_hook).validate(QuantizedDeltaState())
    dah.hook_spec(int2_compress_hook).validate(QuantizedDeltaState(block_size=4))
    assert dah.hook_spec(int8_compress_hook).needs_anchor
    assert dah.hook_spec(int4_compress_hook).needs_anchor


def test_state_dict_round_trip_and_mismatch(world1):
    w = torch.nn.Parameter(torch.full((100,), 3.0))
    bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
    state = QuantizedDeltaState(block_size=16)
    with torch.no_grad():
        w.add_(torch.linspace(-1e-3, 2e-3, 100))
    run_round(int4_compress_hook, state, [bucket])
    saved = state.state_dict()
    assert saved["block_size"] == 16 and saved["residuals"][0].abs().max() > 0
    fresh = QuantizedDeltaState(block_size=16)
    fresh.load_state_dict(saved)  # before the bucket's first use: kept waiting
    assert torch.equal(fresh.state_dict()["residuals"][0], saved["residuals"][0])
    with pytest.raises(ValueError, match="block_size=16, this state 128"):
        QuantizedDeltaState().load_state_dict(saved)
    import pickle
    restored = pickle.loads(pickle.dumps(state))
    assert torch.equal(restored.state_dict()["residuals"][0], saved["residuals"][0])


@pytest.mark.parametrize("hook", [int8_compress_hook, int4_compress_hook, int2_compress_hook])
def test_single_rank_round_is_within_one_rounding(world1, hook):
    # one rank: the result is the rank's own dequantized delta
    w = torch.nn.Parameter(torch.full((1000,), 5.0, dtype=torch.float64))
    bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
    with torch.no_grad():
        w[:500].add_(torch.linspace(-1e-2, 1e-2, 500, dtype=torch.float64))
    target = w.detach().clone()
    run_round(hook, None, [bucket])
    # within one rounding of the block maximum 1e-2: 1 / (2 Q) of it, 2-bit codes all of it
    share = {int8_compress_hook: 1 / 254, int4_compress_hook: 1 / 14, int2_compress_hook: 1}[hook]
    assert (w.detach() - target).abs().max() <= 2 * K_SLACK * 1e-2 * share
    # zero blocks: exactly unchanged (2-bit codes have no zero level: only whole blocks)
    still = 512 if hook is int2_compress_hook else 500
    assert torch.equal(w.detach()[still:], target[still:])
    residual = bucket.memory()["quant_residual"]
    torch.testing.assert_close(w.detach() - residual, target, rtol=0, atol=1e-15)
