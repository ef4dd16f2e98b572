"""``ops.feedback_cast``, ``ops.apply_delta_`` and ``ops.apply_progress_``: bit for bit
against plain torch, in chunks.

The references here are written from the documented rule (float32 arithmetic, float64
when a tensor is float64, one rounding per output) with whole-tensor torch ops; both
tiers of ``_fallback`` (per-tensor reference and chunked foreach) must match them, for
any chunk size, mixed parameter dtypes and a channels-last parameter.
"""

from __future__ import annotations

import pytest
import torch

from ddp_avg_hooks import _ext, _fallback, ops

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
TIERS = {"reference": (_fallback.feedback_cast, _fallback.apply_delta_,
                       _fallback.apply_progress_),
         "foreach": (_fallback.foreach_feedback_cast, _fallback.foreach_apply_delta_,
                     _fallback.foreach_apply_progress_),
         "ext": None, "ext_scalar": None}  # the extension, with its CPU vector bodies off
KERNEL_DTYPES = (F32, F16, BF16)


@pytest.fixture
def tier_ops(request, tier):
    """``(feedback_cast, apply_delta_, apply_progress_)`` of one tier; the extension's only
    for the calls it takes (kernel dtypes, the anchor in the parameters' dtype)."""
    if TIERS[tier] is not None:
        yield TIERS[tier]
        return
    m = _ext.load_extension()
    if m is None:
        pytest.skip("the C++ extension is disabled or could not be built")
    old = m._cpu_simd(-1)
    m._cpu_simd(0 if tier == "ext_scalar" else old)
    try:
        yield m.feedback_cast, m.apply_delta_, m.apply_progress_
    finally:
        m._cpu_simd(old)


def _ext_takes(tier, anchor, ps, *flats):
    if tier.startswith("ext") and not (all(t.dtype in KERNEL_DTYPES for t in (anchor, *ps, *flats))
                                       and all(p.dtype == anchor.dtype for p in ps)):
        pytest.skip("the extension takes only kernel dtypes "
                    "with the anchor in the parameters' dtype")


def _params(dtypes):
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3, 5, 5), (37,), (300,), (2, 64)]
    ps = []
    for shape, dt in zip(shapes, dtypes):
        p = (torch.randn(shape, generator=g) * 20).to(dt)
        if len(shape) == 4:
            p = p.to(memory_format=torch.channels_last)  # a non-contiguous parameter
        ps.append(p)
    return ps


def _flat_of(ps, dtype):
    return torch.cat([p.reshape(-1).to(dtype) for p in ps])


def _ct(*dts):
    return F64 if F64 in dts else F32


def _expected_feedback(anchor, ps, residual, out_dtype, scale):
    outs, res = [], []
    off = 0
    for p in ps:
        n = p.numel()
        ct = _ct(anchor.dtype, p.dtype, residual.dtype, out_dtype)
        x = ((anchor[off:off + n].to(ct) - p.reshape(-1).to(ct)) * scale
             + residual[off:off + n].to(ct))
        o = x.to(out_dtype)
        outs.append(o)
        res.append((x - o.to(ct)).to(residual.dtype))
        off += n
    return torch.cat(outs), torch.cat(res)


def _bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("dtypes,out_dtype,res_dtype", [
    ((F32,) * 4, F16, BF16), ((F32,) * 4, BF16, F32), ((F32, BF16, F32, F16), F16, BF16),
    ((F64,) * 4, F16, BF16), ((F32,) * 4, F16, F64), ((BF16,) * 4, F16, BF16),
    ((F16,) * 4, BF16, F32), ((F32,) * 4, BF16, F16)])
@pytest.mark.parametrize("scale", [1.0, 1 / 3])
def test_feedback_cast_matches_the_rule(monkeypatch, tier, tier_ops, chunk, dtypes, out_dtype,
                                        res_dtype, scale):
    monkeypatch.setattr(_fallback, "_CPU_CHUNK", chunk)
    ps = _params(dtypes)
    anchor_dtype = F64 if F64 in dtypes else dtypes[0] if len(set(dtypes)) == 1 else F32
    g = torch.Generator().manual_seed(1)
    anchor = _flat_of(ps, anchor_dtype) + torch.randn(sum(p.numel() for p in ps), generator=g,
                                                      dtype=anchor_dtype) * 1e-2
    residual = (torch.randn(anchor.numel(), generator=g) * 1e-5).to(res_dtype)
    want_out, want_res = _expected_feedback(anchor, ps, residual, out_dtype, scale)
    out = torch.empty(anchor.numel(), dtype=out_dtype)
    _ext_takes(tier, anchor, ps, residual, out)
    tier_ops[0](anchor, ps, residual, out, scale)
    assert _bits_equal(out, want_out)
    assert _bits_equal(residual, want_res)
    assert residual.abs().max() > 0


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("dtypes,change_dtype", [
    ((F32,) * 4, F16), ((F32,) * 4, BF16), ((F32,) * 4, F32), ((BF16,) * 4, F16),
    ((F64,) * 4, F16), ((F32,) * 4, F64), ((F16,) * 4, BF16)])
def test_apply_delta_matches_the_rule(monkeypatch, tier, tier_ops, chunk, dtypes, change_dtype):
    monkeypatch.setattr(_fallback, "_CPU_CHUNK", chunk)
    ps = _params(dtypes)
    ptrs, strides = [p.data_ptr() for p in ps], [p.stride() for p in ps]
    anchor = _flat_of(ps, dtypes[0]) + 0.25
    g = torch.Generator().manual_seed(2)
    change = (torch.randn(anchor.numel(), generator=g) * 1e-3).to(change_dtype)
    ct = _ct(anchor.dtype, change.dtype, dtypes[0])
    want = (anchor.to(ct) - change.to(ct)).to(dtypes[0])
    _ext_takes(tier, anchor, ps, change)
    tier_ops[1](anchor, change, ps)
    assert _bits_equal(_flat_of(ps, dtypes[0]), want)
    assert _bits_equal(anchor, want)
    assert [p.data_ptr() for p in ps] == ptrs and [p.stride() for p in ps] == strides


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("chunk", [7, 1 << 20])
@pytest.mark.parametrize("dtypes,values_dtype", [
    ((F32,) * 4, F32), ((F32,) * 4, F16), ((BF16,) * 4, F32), ((BF16,) * 4, BF16),
    ((F16,) * 4, F32), ((F64,) * 4, F32), ((F32,) * 4, F64)])
@pytest.mark.parametrize("with_anchor", [True, False])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
def test_apply_progress_matches_the_rule(monkeypatch, tier, tier_ops, chunk, dtypes,
                                         values_dtype, with_anchor, layout):
    # an overlapped round: each parameter keeps its progress since the launch snapshot
    # (without an anchor, only the parameters are written)
    monkeypatch.setattr(_fallback, "_CPU_CHUNK", chunk)
    ps = _params(dtypes)
    if layout == "contiguous":  # the foreach tier chunks these without an anchor
        ps = [p.contiguous() for p in ps]
    ptrs, strides = [p.data_ptr() for p in ps], [p.stride() for p in ps]
    dt = dtypes[0]
    g = torch.Generator().manual_seed(5)
    n = sum(p.numel() for p in ps)
    for p in ps:  # small against the corrections, so that both roundings of the rule show
        p.mul_(1e-3)
    launch = torch.randn(n, generator=g, dtype=F64).to(dt)
    values = (launch.to(F64) + torch.randn(n, generator=g, dtype=F64)).to(values_dtype)
    params_now = _flat_of(ps, dt)
    # the rule, with whole-tensor ops: the correction rounded to the parameters' dtype,
    # then added in their arithmetic (float32, float64 for float64)
    correction = (values.to(_ct(values_dtype, dt)) - launch.to(_ct(values_dtype, dt))).to(dt)
    want = (params_now.to(_ct(dt)) + correction.to(_ct(dt))).to(dt)
    anchor, kept = torch.zeros(n, dtype=dt), launch.clone()
    _ext_takes(tier, anchor, ps, values, launch)
    tier_ops[2](values, launch, ps, anchor if with_anchor else None)
    assert _bits_equal(_flat_of(ps, dt), want)
    assert not torch.equal(want, values.to(dt))  # the progress was kept, not overwritten
    assert _bits_equal(anchor, values.to(dt) if with_anchor else torch.zeros(n, dtype=dt))
    assert _bits_equal(launch, kept)
    assert [p.data_ptr() for p in ps] == ptrs and [p.stride() for p in ps] == strides


def test_apply_progress_takes_values_that_are_the_anchor():
    # a hook may return the anchor itself (nothing changed): the parameters keep their
    # progress, the anchor its values
    ps = [torch.tensor([3.0, 5.0]), torch.tensor([7.0])]
    anchor, launch = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 6.0])
    ops.apply_progress_(anchor, launch, ps, anchor)
    assert [p.tolist() for p in ps] == [[2.0, 3.0], [4.0]]
    assert anchor.tolist() == [1.0, 2.0, 3.0] and launch.tolist() == [2.0, 4.0, 6.0]


@pytest.mark.parametrize("tier", ["ext", "ext_scalar"])
@pytest.mark.parametrize("pd,od,rd", [(F32, F16, BF16), (BF16, BF16, F32)])
def test_extension_matches_the_foreach_tier_on_a_large_bucket(tier, tier_ops, pd, od, rd):
    # about 1.2M elements over several parameters: the kernels split it over 2 threads
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(3)
        ps = [(torch.randn(n, generator=g) * 3).to(pd) for n in (700_001, 3, 500_000)]
        anchor = _flat_of(ps, pd) + (torch.randn(1_200_004, generator=g) * 1e-2).to(pd)
        residual = (torch.randn(anchor.numel(), generator=g) * 1e-4).to(rd)
        outs = []
        launch = (anchor.float() - 1e-3).to(pd)
        for feedback, apply_delta, apply_progress in (tier_ops, TIERS["foreach"]):
            qs, a, r = [p.clone() for p in ps], anchor.clone(), residual.clone()
            o = torch.empty(a.numel(), dtype=od)
            feedback(a, qs, r, o, 0.5)
            apply_delta(a, o, qs)
            apply_progress(o, launch, qs, a)
            outs.append((o, r, a, qs))
        for got, want in zip(*outs):
            for x, y in zip(got if isinstance(got, list) else [got],
                            want if isinstance(want, list) else [want]):
                assert _bits_equal(x, y)
    finally:
        torch.set_num_threads(old)


def test_ops_allocate_far_less_than_the_bucket(monkeypatch):
    monkeypatch.setattr(_fallback, "_CPU_CHUNK", 1 << 14)
    ps = [torch.randn(512, 512), torch.randn(512)]
    n = sum(p.numel() for p in ps)
    anchor, residual = _flat_of(ps, F32) + 1e-3, torch.zeros(n, dtype=BF16)
    out = torch.empty(n, dtype=F16)
    ops.feedback_cast(anchor, ps, residual, out, 0.5)  # warm the scratch buffers
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        ops.feedback_cast(anchor, ps, residual, out, 0.5)
        ops.apply_delta_(anchor, out, ps)
    largest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert largest < 4 * n // 8, f"allocated {largest} B for a {4 * n} B bucket"


def test_errors_name_the_argument():
    ps = [torch.zeros(4)]
    with pytest.raises(ValueError, match="feedback_cast: residual has 3 elements"):
        ops.feedback_cast(torch.zeros(4), ps, torch.zeros(3), torch.zeros(4, dtype=F16))
    with pytest.raises(TypeError, match="apply_delta_: anchor has dtype torch.float16 but params"):
        ops.apply_delta_(torch.zeros(4, dtype=F16), torch.zeros(4), ps)
    with pytest.raises(ValueError, match="apply_delta_: change must be a contiguous 1-D"):
        ops.apply_delta_(torch.zeros(4), torch.zeros(2, 2), ps)
    with pytest.raises(TypeError, match="apply_progress_: launch has dtype torch.bfloat16 but"):
        ops.apply_progress_(torch.zeros(4), torch.zeros(4, dtype=BF16), ps, torch.zeros(4))
    with pytest.raises(ValueError, match="apply_progress_: anchor has 5 elements"):
        ops.apply_progress_(torch.zeros(4), torch.zeros(4), ps, torch.zeros(5))


def test_the_extension_takes_the_calls_its_kernels_can_run():
    m = _ext.load_extension()
    if m is None:
        pytest.skip("the C++ extension is disabled or could not be built")
    ps = [torch.zeros(4), torch.zeros(2)]
    anchor, half = torch.zeros(6), torch.zeros(6, dtype=F16)
    assert ops._feedback_impl(anchor, (anchor, half, half), ps) is m
    assert ops._feedback_impl(anchor.double(), (anchor.double(), half), ps) is ops._FOREACH
    mixed = [torch.zeros(4), torch.zeros(2, dtype=BF16)]  # the anchor is not every param's dtype
    assert ops._feedback_impl(anchor, (anchor, half), mixed) is ops._FOREACH


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("pd,od,rd", [(F32, F16, BF16), (BF16, BF16, F32), (F16, BF16, F16)])
def test_cuda_kernels_match_the_cpu_reference(pd, od, rd):
    m = _ext.load_extension()
    if m is None or not m.with_cuda():
        pytest.skip("the extension was not built with CUDA")
    g = torch.Generator().manual_seed(4)
    # sizes around the kernels' chunk and vector widths, and one misaligned start
    ps = [(torch.randn(n, generator=g) * 3).to(pd) for n in (4096, 4097, 1, 70_001)]
    n = sum(p.numel() for p in ps)
    anchor = _flat_of(ps, pd) + (torch.randn(n, generator=g) * 1e-2).to(pd)
    residual = (torch.randn(n, generator=g) * 1e-4).to(rd)
    change = (torch.randn(n, generator=g) * 1e-3).to(od)
    want_out, want_res = _expected_feedback(anchor, ps, residual, od, 0.25)
    want_new = (anchor.float() - change.float()).to(pd)
    dps = [p.cuda() for p in ps]
    da, dr, dout = anchor.cuda(), residual.cuda(), torch.empty(n, dtype=od, device="cuda")
    m.feedback_cast(da, dps, dr, dout, 0.25)
    assert _bits_equal(dout.cpu(), want_out) and _bits_equal(dr.cpu(), want_res)
    m.apply_delta_(da, change.cuda(), dps)
    assert _bits_equal(da.cpu(), want_new)
    assert _bits_equal(_flat_of([p.cpu() for p in dps], pd), want_new)
    # an overlapped round's write, from the parameters just written
    launch = (want_new.float() - 1e-2).to(pd)
    values = (want_new.float() + (torch.randn(n, generator=g) * 1e-3)).to(od)
    want_params = (want_new.float() + (values.float() - launch.float()).to(pd).float()).to(pd)
    m.apply_progress_(values.cuda(), launch.cuda(), dps, da)
    assert _bits_equal(_flat_of([p.cpu() for p in dps], pd), want_params)
    assert _bits_equal(da.cpu(), values.to(pd))
