"""The fused bucket ops: extension, foreach tier and reference agree bit for bit with plain torch.

Every op runs under each implementation ("ext": the compiled module called directly;
"foreach": the ``torch._foreach_*`` tier of ``_fallback``; "reference": its per-tensor
loop) and is compared with a reference computed here from ``torch.cat`` /
``Tensor.to``. Values mix random bit patterns (every class of float: subnormals, nan,
inf, huge) with hand-picked rounding ties and values beyond fp16's range. NaN payloads
are not compared (torch's own code paths disagree on them); everything else, signed
zeros included, must match bit for bit. Argument errors and routing are ``ops``'s own.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddp_avg_hooks import _ext, _fallback, _quantize, ops

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PAIRS = [(a, b) for a in DTYPES for b in DTYPES]
_INT = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
        torch.float64: torch.int64}
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
REPO = Path(__file__).resolve().parent.parent

# Rounding ties, range limits and special values (exact as float32).
SPECIALS = torch.tensor(
    [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"),
     65504.0, 65519.99609375, 65520.0, -65520.0, 65536.0, 7e4, -1e5, 3.4e38, -3.4e38,
     1e-40, -1e-45, 1.1754942e-38,                    # float32 subnormals / min normal
     2.0**-24, 2.0**-25, 3 * 2.0**-25, -(2.0**-25),   # fp16 subnormal ties
     6.1035156e-05, 6.0975552e-05,
     1 + 2.0**-11, 1 + 3 * 2.0**-11,                  # fp16 / bf16 ties
     1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8),
     3.3895314e38, 3.4028235e38, 1e-8, -5.9604645e-08],
    dtype=torch.float32,
)
SCALES = [None, 1.0 / 3.0, 2.0**-10, 1e30]


# ---------------------------------------------------------------- helpers

def assert_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Same dtype and shape; equal bits wherever ``expected`` is not NaN, NaN where it is."""
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = actual.detach().cpu().contiguous(), expected.detach().cpu().contiguous()
    nan = e.isnan()
    assert torch.equal(a.isnan(), nan), f"{what}: NaN positions differ"
    it = _INT[a.dtype]
    same = (a.view(it) == e.view(it)) | nan
    if not bool(same.all()):
        i = int((~same).reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what}: {int((~same).sum())} elements differ, first at {i}: "
            f"{a.reshape(-1)[i].item()!r} vs expected {e.reshape(-1)[i].item()!r}"
        )


def values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n values of ``dtype``: specials first, then random bits and random magnitudes."""
    return _values(n, dtype, seed).clone()


@functools.lru_cache(maxsize=64)
def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    it = _INT[dtype]
    info = torch.iinfo(it)
    bits = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(it)
    scale = torch.exp2(torch.randint(-30, 20, (n,), generator=g).double())
    normal = (torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dtype)
    x = torch.where(torch.rand(n, generator=g) < 0.5, normal, bits.view(dtype))
    k = min(n, len(SPECIALS))
    start = seed % max(1, n - k + 1)
    x[start : start + k] = SPECIALS[:k].to(dtype)
    return x


def make_params(case: str, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    """A parameter list for one test case; every tensor filled by ``values``."""
    def fill(t: torch.Tensor, s: int) -> torch.Tensor:
        with torch.no_grad():
            t.copy_(values(t.numel(), dtype, s).view(t.shape))
        return t

    def new(*shape: int, s: int) -> torch.Tensor:
        return fill(torch.empty(shape, dtype=dtype, device=device), s)

    if case == "empty":
        return [torch.empty(0, dtype=dtype, device=device),
                torch.empty(0, 3, dtype=dtype, device=device)]
    if case == "one":
        return [new(1, s=seed), fill(torch.empty((), dtype=dtype, device=device), seed + 1)]
    if case == "odd":
        return [new(7, s=seed), new(3, 5, s=seed + 1), new(1, s=seed + 2),
                new(13, 7, 3, s=seed + 3)]
    if case == "noncontig":
        cl = new(2, 3, 5, 7, s=seed).contiguous(memory_format=torch.channels_last)
        t = new(5, 9, s=seed + 1).t()                        # transposed
        st = new(40, s=seed + 2)[1::3]                       # strided, with storage offset
        off = new(17, s=seed + 3)[1:]                        # contiguous, odd storage offset
        return [cl, new(3, s=seed + 4), t, st, off]
    if case == "many":  # more tensors than one CUDA launch takes
        return [new(1 + (7 * i) % 23, s=seed + i) for i in range(100)]
    if case == "large":  # ~1M elements, several threads
        return [new(1000, 1000, s=seed), new(48_577, s=seed + 1), new(3, s=seed + 2)]
    raise ValueError(case)


CASES = ["empty", "one", "odd", "noncontig", "many", "large"]


def numel(ps: list[torch.Tensor]) -> int:
    return sum(p.numel() for p in ps)


def ref_flatten(ps, out_dtype, scale):
    parts = [p.reshape(-1) if scale is None else p.reshape(-1).float() * scale for p in ps]
    return torch.cat([x.to(out_dtype) for x in parts]) if parts else torch.empty(0, dtype=out_dtype)


def ref_split(flat, ps):
    out, off = [], 0
    for p in ps:
        out.append(flat[off : off + p.numel()].view(p.shape).to(p.dtype))
        off += p.numel()
    return out


# ---------------------------------------------------------------- implementations

def _ext_module():
    m = _ext.load_extension()
    if m is None:
        reason = ("DDP_AVG_HOOKS_DISABLE_EXT is set" if _ext.disabled()
                  else "the C++ extension could not be built or loaded (see the warning)")
        pytest.skip(reason)
    return m


class _Ext:
    """The extension called directly (it runs every call of kernel dtypes it is given)."""

    def __init__(self, m):
        self.m = m

    def flatten(self, params, out, scale=None):
        assert self.m.flatten(params, out, scale) is None
        return out

    def unflatten_(self, flat, params):
        self.m.unflatten_(flat, params)

    def delta(self, anchor, params, out, scale=1.0):
        assert self.m.delta(anchor, params, out, scale) is None
        return out

    def apply_(self, flat, params, anchor=None):
        self.m.apply_(flat, params, anchor)


FOREACH = ops._FOREACH  # _fallback.foreach_flatten, ... under the ops' names


@pytest.fixture(params=["ext", "ext_scalar", "foreach", "reference"])
def impl(request):
    """ext_scalar: the extension with its CPU vector (AVX2/F16C) bodies off."""
    if request.param == "reference":
        yield _fallback
        return
    if request.param == "foreach":
        yield FOREACH
        return
    m = _ext_module()
    if request.param == "ext":
        yield _Ext(m)
        return
    old = m._cpu_simd(-1)
    m._cpu_simd(0)
    e = _Ext(m)
    e.scalar = True
    try:
        yield e
    finally:
        m._cpu_simd(old)


# CUDA variants of every correctness test exist only where a GPU does
# (test_cuda_device_present reports the skip once).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request, impl):
    if request.param == "cuda" and isinstance(impl, _Ext) and not impl.m.with_cuda():
        pytest.skip("extension built without CUDA (torch.cuda.is_available() but no CUDA_HOME?)")
    return request.param


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: CUDA correctness tests not collected")
def test_cuda_device_present():
    m = _ext.load_extension()
    if m is not None:
        assert m.with_cuda(), "a GPU is present but the extension was built without CUDA"


@pytest.fixture(autouse=True)
def one_thread():
    """References run on one thread (the suite shares few cores); see ``op_threads``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@contextlib.contextmanager
def op_threads(case: str):
    """The op under test gets two threads on the large case (the extension splits it)."""
    torch.set_num_threads(2 if case == "large" else 1)
    try:
        yield
    finally:
        torch.set_num_threads(1)


@pytest.fixture
def threads(request, impl):
    if getattr(impl, "scalar", False) and request.node.callspec.params.get("case") == "large":
        pytest.skip("ext_scalar: the small cases cover the scalar conversions")


def _ids(pair):
    return f"{_SHORT[pair[0]]}-{_SHORT[pair[1]]}"


# ---------------------------------------------------------------- correctness

@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_flatten(impl, device, case, pair, threads):
    pd, od = pair
    ps = make_params(case, pd, device, seed=1)
    before = [p.clone() for p in ps]
    scales = SCALES if case in ("odd", "noncontig", "large") else [None, 1.0 / 3.0]
    for scale in scales:
        out = torch.full((numel(ps),), 7.0, dtype=od, device=device)
        with op_threads(case):
            assert impl.flatten(ps, out, scale=scale) is out
        assert_bits(out, ref_flatten(ps, od, scale), f"flatten scale={scale}")
    for p, b in zip(ps, before):  # inputs untouched
        assert_bits(p, b, "flatten modified a parameter")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
def test_unflatten(impl, device, case, pair, threads):
    pd, fd = pair
    ps = make_params(case, pd, device, seed=2)
    layout = [(p.data_ptr(), p.stride()) for p in ps]
    flat = values(numel(ps), fd, seed=3).to(device)
    flat_before = flat.clone()
    with op_threads(case):
        assert impl.unflatten_(flat, ps) is None
    for i, (p, e) in enumerate(zip(ps, ref_split(flat, ps))):
        assert_bits(p, e, f"unflatten params[{i}]")
    assert [(p.data_ptr(), p.stride()) for p in ps] == layout  # in place, layout kept
    assert_bits(flat, flat_before, "unflatten modified flat")


# (case, param dtype, anchor dtype, out dtype): all 27 dtype triples on the odd and
# noncontig cases, anchor dtype == param dtype elsewhere.
DELTA_CASES = [
    pytest.param(case, pd, ad, od, id=f"{_SHORT[pd]}-{_SHORT[ad]}-{_SHORT[od]}-{case}")
    for case in CASES for pd in DTYPES for ad in DTYPES for od in DTYPES
    if case in ("odd", "noncontig") or pd == ad
]


@pytest.mark.parametrize("case,pd,ad,od", DELTA_CASES)
def test_delta(impl, device, case, pd, ad, od, threads):
    ps = make_params(case, pd, device, seed=4)
    anchor = values(numel(ps), ad, seed=5).to(device)
    for scale in (1.0, 0.125, 1.0 / 3.0):
        out = torch.empty(numel(ps), dtype=od, device=device)
        with op_threads(case):
            assert impl.delta(anchor, ps, out, scale=scale) is out
        cat = (torch.cat([p.reshape(-1).float() for p in ps]) if ps
               else torch.empty(0, device=device))
        expected = ((anchor.float() - cat) * scale).to(od)
        assert_bits(out, expected, f"delta scale={scale}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("pair", PAIRS, ids=_ids)
@pytest.mark.parametrize("with_anchor", [True, False], ids=["anchor", "no_anchor"])
def test_apply(impl, device, case, pair, with_anchor, threads):
    pd, fd = pair
    ps = make_params(case, pd, device, seed=6)
    ptrs = [p.data_ptr() for p in ps]
    flat = values(numel(ps), fd, seed=7).to(device)
    anchor = torch.empty(numel(ps), dtype=pd, device=device) if with_anchor else None
    with op_threads(case):
        assert impl.apply_(flat, ps, anchor) is None
    expected = ref_split(flat, ps)
    for i, (p, e) in enumerate(zip(ps, expected)):
        assert_bits(p, e, f"apply params[{i}]")
    assert [p.data_ptr() for p in ps] == ptrs
    if with_anchor:
        cat = (torch.cat([p.reshape(-1) for p in ps]) if ps
               else torch.empty(0, dtype=pd, device=device))
        assert_bits(anchor, cat, "apply anchor")


def test_mixed_param_dtypes(impl, device):
    """One call over parameters of several dtypes (the extension groups them)."""
    ps = [make_params("odd", d, device, seed=i)[i % 4] for i, d in enumerate(DTYPES * 2)]
    out = torch.empty(numel(ps), dtype=torch.bfloat16, device=device)
    impl.flatten(ps, out, scale=0.5)
    assert_bits(out, ref_flatten(ps, torch.bfloat16, 0.5), "flatten mixed")
    flat = values(numel(ps), torch.float32, seed=9).to(device)
    impl.unflatten_(flat, ps)
    for i, (p, e) in enumerate(zip(ps, ref_split(flat, ps))):
        assert_bits(p, e, f"unflatten mixed params[{i}]")


def test_bumps_version_counter(impl):
    ps = [torch.zeros(3), torch.zeros(2, 2).t()]
    out = torch.empty(7)
    v = [p._version for p in ps]
    impl.unflatten_(torch.ones(7), ps)
    assert all(p._version > w for p, w in zip(ps, v))
    vo = out._version
    impl.flatten(ps, out)
    assert out._version > vo


# ---------------------------------------------------------------- foreach vs reference vs ext

def _mixed_params(pdt, layout, seed):
    """Parameters of the dtypes ``pdt`` (cycled), in one of a few layouts, with empties."""
    shapes = [(2, 3, 5, 7), (9,), (5, 9), (0,), (40,), (0, 3), (17,), (33, 65)]
    ps = []
    for i, shape in enumerate(shapes):
        dt = pdt[i % len(pdt)]
        t = values(max(1, math.prod(shape)), dt, seed + i)[: math.prod(shape)].view(shape)
        if layout == "noncontig" and t.dim() == 4:
            t = t.contiguous(memory_format=torch.channels_last)
        elif layout == "noncontig" and t.dim() == 2 and t.numel():
            t = t.t().contiguous().t()  # transposed view of the same logical values
        elif layout == "noncontig" and t.numel() == 40:
            t = torch.stack([t, t], dim=1)[:, 0]  # strided
        ps.append(t)
    return ps


MIXES = [pytest.param(pdt, fd, ad, layout,
                      id=f"{'+'.join(_SHORT[d] for d in pdt)}-{_SHORT[fd]}-{_SHORT[ad]}-{layout}")
         for pdt, fd, ad in [
             ((torch.float32,), torch.float16, torch.float32),
             ((torch.float16,), torch.float16, torch.float16),
             ((torch.bfloat16,), torch.bfloat16, torch.bfloat16),
             ((torch.float16, torch.bfloat16), torch.float32, torch.bfloat16),
             ((torch.float32, torch.float16, torch.bfloat16), torch.bfloat16, torch.float16),
             ((torch.float64,), torch.float16, torch.float64),
             ((torch.float64,), torch.float32, torch.float16),
             ((torch.float32,), torch.float64, torch.float32),
             ((torch.float16,), torch.bfloat16, torch.float64),
             ((torch.float64, torch.float32, torch.float16), torch.float32, torch.float32),
             ((torch.float64, torch.bfloat16), torch.float16, torch.bfloat16),
             ((torch.bfloat16, torch.float64), torch.float64, torch.float64),
         ]
         for layout in ("contig", "noncontig")]


def _impls_for(tensors):
    impls = {"reference": _fallback, "foreach": FOREACH}
    m = _ext.load_extension()
    if m is not None and all(t.dtype in DTYPES for t in tensors):
        impls["ext"] = _Ext(m)
    return impls


def _same_across(results):
    names = list(results)
    for name in names[1:]:
        for i, (a, b) in enumerate(zip(results[name], results[names[0]])):
            assert_bits(a, b, f"{name} vs {names[0]} tensor {i}")


@pytest.mark.parametrize("pdt,fd,ad,layout", MIXES)
def test_tiers_agree(pdt, fd, ad, layout):
    """Each op under every implementation that takes the call: identical bits."""
    ps = _mixed_params(pdt, layout, seed=21)
    n = numel(ps)
    anchor = values(n, ad, seed=22)
    flat = values(n, fd, seed=23)
    for scale in (None, 1.0, 1.0 / 3.0, 1e30):
        res = {name: [impl.flatten(ps, torch.full((n,), 7.0, dtype=fd), scale)]
               for name, impl in _impls_for([*ps, flat]).items()}
        _same_across(res)
        if scale is not None:
            res = {name: [impl.delta(anchor, ps, torch.full((n,), 7.0, dtype=fd), scale)]
                   for name, impl in _impls_for([*ps, flat, anchor]).items()}
            _same_across(res)
    res = {}
    for name, impl in _impls_for([*ps, flat]).items():
        qs = [p.clone() for p in ps]  # clone keeps the layout
        impl.unflatten_(flat, qs)
        res[name] = qs
    _same_across(res)
    for i, (q, e) in enumerate(zip(res["reference"], ref_split(flat, ps))):
        assert_bits(q, e, f"unflatten params[{i}]")
    same = [p.to(pdt[0]) for p in ps]  # apply_'s anchor has the parameters' dtype
    res = {}
    for name, impl in _impls_for([*same, flat]).items():
        qs = [p.clone() for p in same]
        an = torch.empty(n, dtype=pdt[0])
        impl.apply_(flat, qs, an)
        res[name] = [*qs, an]
    _same_across(res)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_foreach_steps_split_tensors(monkeypatch, chunk):
    """Small CPU steps: tensors split across steps and steps spanning tensors."""
    monkeypatch.setattr(_fallback, "_CPU_CHUNK", chunk)
    ps = _mixed_params((torch.float32, torch.float16, torch.float64), "noncontig", seed=41)
    n = numel(ps)
    anchor = values(n, torch.bfloat16, seed=42)
    for od in (torch.float16, torch.float32):
        assert_bits(FOREACH.flatten(ps, torch.empty(n, dtype=od), 0.75),
                    _fallback.flatten(ps, torch.empty(n, dtype=od), 0.75), "flatten")
        assert_bits(FOREACH.delta(anchor, ps, torch.empty(n, dtype=od), 0.1),
                    _fallback.delta(anchor, ps, torch.empty(n, dtype=od), 0.1), "delta")


def test_foreach_delta_aliasing_and_scale_one():
    """out may be the anchor itself; scale 1.0 gives (anchor - p) exactly."""
    ps = make_params("odd", torch.float32, "cpu", seed=31)
    n = numel(ps)
    ref = _fallback.delta(values(n, torch.float32, 32), ps, torch.empty(n), 1.0)
    a = values(n, torch.float32, 32)
    assert FOREACH.delta(a, ps, a, 1.0) is a
    assert_bits(a, ref, "delta into its own anchor")


# ---------------------------------------------------------------- errors

def _bad_calls():
    """name -> (call, exception type, start of the message) for ``ops``."""
    f32, f16 = torch.float32, torch.float16
    p = [torch.ones(3), torch.ones(2, 2)]
    V, T = ValueError, TypeError
    return {
        "flatten-size": (lambda m: m.flatten(p, torch.empty(6)), V,
                         "flatten: out has 6 elements but the parameters hold 7"),
        "flatten-2d": (lambda m: m.flatten(p, torch.empty(7, 1)), V,
                       "flatten: out must be a contiguous 1-D tensor, got shape (7, 1)"),
        "flatten-strided": (lambda m: m.flatten(p, torch.empty(14)[::2]), V,
                            "flatten: out must be a contiguous 1-D tensor"),
        "flatten-int-param": (lambda m: m.flatten([torch.ones(3, dtype=torch.int32)],
                                                  torch.empty(3)),
                              T, "flatten: params[0] has dtype torch.int32; supported dtypes"),
        "flatten-int-out": (lambda m: m.flatten(p, torch.empty(7, dtype=torch.int64)), T,
                            "flatten: out has dtype torch.int64"),
        "flatten-f64-size": (lambda m: m.flatten([torch.ones(3, dtype=torch.float64)],
                                                 torch.empty(4)),
                             V, "flatten: out has 4 elements"),
        "flatten-device": (lambda m: m.flatten([torch.ones(3, device="meta")], torch.empty(3)), V,
                           "flatten: params[0] is on meta but out is on cpu"),
        "flatten-not-tensor": (lambda m: m.flatten([torch.ones(3), 1.0], torch.empty(4)), T,
                               "flatten: params[1] must be a torch.Tensor, got float"),
        "flatten-out-not-tensor": (lambda m: m.flatten(p, [0.0] * 7), T,
                                   "flatten: out must be a torch.Tensor, got list"),
        "unflatten-size": (lambda m: m.unflatten_(torch.empty(8), p), V,
                           "unflatten_: flat has 8 elements"),
        "unflatten-bool": (lambda m: m.unflatten_(torch.empty(7, dtype=torch.bool), p), T,
                           "unflatten_: flat has dtype torch.bool"),
        "delta-anchor-size": (lambda m: m.delta(torch.empty(6), p, torch.empty(7)), V,
                              "delta: anchor has 6 elements"),
        "delta-out-size": (lambda m: m.delta(torch.empty(7), p, torch.empty(8, dtype=f16)), V,
                           "delta: out has 8 elements"),
        "delta-out-int": (lambda m: m.delta(torch.empty(7), p, torch.empty(7, dtype=torch.int8)), T,
                          "delta: out has dtype torch.int8"),
        "apply-anchor-dtype": (lambda m: m.apply_(torch.empty(7), p, torch.empty(7, dtype=f16)), T,
                               "apply_: anchor has dtype torch.float16 "
                               "but params[0] has torch.float32"),
        "apply-anchor-size": (lambda m: m.apply_(torch.empty(7, dtype=f32), p, torch.empty(6)), V,
                              "apply_: anchor has 6 elements"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_error_type_and_message(name):
    call, exc, msg = _bad_calls()[name]
    with pytest.raises(exc) as got:
        call(ops)
    assert type(got.value) is exc
    assert str(got.value).startswith(msg), str(got.value)


@pytest.mark.parametrize("name", ["flatten-size", "flatten-2d", "flatten-strided",
                                  "flatten-int-out", "unflatten-size", "delta-anchor-size",
                                  "delta-out-size", "apply-anchor-dtype", "apply-anchor-size"])
def test_extension_asserts_its_invariants(name):
    """Unvalidated calls into the binding fail loudly instead of writing out of bounds."""
    call = _bad_calls()[name][0]
    with pytest.raises(RuntimeError):
        call(_ext_module())


# ---------------------------------------------------------------- routing and loading

def test_routing():
    m = _ext.load_extension()
    assert ops.backend() == ("extension" if m is not None else "fallback")
    f32, f16, f64 = (torch.ones(3), torch.ones(3, dtype=torch.float16),
                     torch.ones(3, dtype=torch.float64))
    fast = "extension" if m is not None else "foreach"
    assert ops._route([torch.empty(6)], [f32, f16]) == fast
    assert ops._route([torch.empty(6, dtype=torch.bfloat16)], [f32.t(), f16]) == fast
    assert ops._route([torch.empty(6)], [f32, f64]) == "foreach"  # float64: never the extension
    assert ops._route([torch.empty(3, dtype=torch.float64)], [f32]) == "foreach"
    assert ops._route([torch.empty(3)], [torch.nn.Parameter(f32)]) == fast
    # a tensor subclass
    assert ops._route([torch.empty(6)], [f32, f16.as_subclass(_Sub)]) == "reference"
    meta = torch.empty(3, device="meta")
    assert ops._route([meta], [meta]) == "reference"  # no foreach kernels on meta
    if m is not None:
        with pytest.raises(RuntimeError):  # and the binding refuses what it cannot run
            m.flatten([f64], torch.empty(3))


class _Sub(torch.Tensor):
    pass


def test_ops_runs_every_route(monkeypatch):
    """The public ops give the same bits whichever implementation ``_route`` picks."""
    routes = ["foreach", "reference"] + (["extension"] if _ext.load_extension() is not None else [])
    ps = make_params("noncontig", torch.float32, "cpu", seed=11)
    ps[1] = ps[1].half()
    n = numel(ps)
    anchor = values(n, torch.float32, seed=12)
    results = {}
    for route in routes:
        monkeypatch.setattr(ops, "_route", lambda flats, params, r=route: r)
        out = ops.flatten(ps, torch.empty(n, dtype=torch.bfloat16), 0.25)
        d = ops.delta(anchor, ps, torch.empty(n, dtype=torch.float16), 1.0 / 3.0)
        qs = [p.clone() for p in ps]
        ops.unflatten_(anchor, qs)
        an = torch.empty(n)
        ops.apply_(anchor, [q.float() for q in qs], an)
        results[route] = [out, d, *qs, an]
    for route in routes[1:]:
        for i, (a, b) in enumerate(zip(results[route], results[routes[0]])):
            assert_bits(a, b, f"{route} vs {routes[0]} result {i}")
    assert ops.unflatten_(torch.arange(5.0), (p for p in [torch.ones(3), torch.ones(2)])) is None


def test_no_build_at_import_and_disable_env():
    code = (
        "import sys, ddp_avg_hooks, ddp_avg_hooks.ops as ops\n"
        "assert not any(k.startswith('ddp_avg_hooks_C') for k in sys.modules), 'loaded at import'\n"
        "assert ops.backend() == 'fallback'\n"
        "import torch; o = ops.flatten([torch.ones(2)], torch.empty(2, dtype=torch.half), 0.5)\n"
        "assert o.tolist() == [0.5, 0.5]\n"
    )
    env = dict(os.environ, DDP_AVG_HOOKS_DISABLE_EXT="1", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO, timeout=120)


# ---------------------------------------------------------------- blockwise quantization
# The fused kernels (quantize; dequantize, back to back or summing the pieces) against the
# plain-PyTorch reference of ``_quantize``: identical bytes and bits, signed zeros included,
# on finite inputs (zeros, subnormals, huge values, odd lengths, partial blocks).

QLAYOUTS = [  # (numel, block, pieces, piece_elems or None: as a bucket of that many ranks)
    pytest.param(1000, 32, 4, None, id="4-pieces"),
    pytest.param(7, 2, 1, 8, id="odd-count"),
    pytest.param(129, 128, 2, None, id="partial-block"),
    pytest.param(0, 4, 2, 4, id="empty"),
    pytest.param(1001, 10, 3, None, id="block-10"),
    pytest.param(333, 64, 1, 384, id="padding"),
    pytest.param(300_001, 128, 2, None, id="large"),  # several threads
]


def _finite(n: int, seed: int) -> torch.Tensor:
    x = values(n, torch.float32, seed)
    x = torch.where(torch.isfinite(x) & (x.abs() < 1e36), x, torch.zeros_like(x))
    if n > 8:
        x[n // 3 : n // 3 + n // 4] = 0.0  # whole zero blocks
        x[n // 2 : n // 2 + 64] = -0.0
    return x


def _qlayout(numel, block, pieces, piece_elems, bits):
    if piece_elems is None:
        return ops.QuantLayout.for_bucket(numel, pieces, block, bits)
    return ops.QuantLayout(bits, block, pieces, piece_elems)


class _QExt:
    def __init__(self, m):
        self.m = m

    def quantize(self, x, packed, layout, residual=None, residual_out=None):
        self.m.quantize_blocks(x, residual, packed, residual_out, layout.bits, layout.block_size,
                               layout.pieces, layout.piece_elems, layout.piece_bytes)

    def dequantize(self, packed, layout, out, sum_pieces=False, base=None):
        self.m.dequantize_blocks(packed, base, out, layout.bits, layout.block_size, layout.pieces,
                                 layout.piece_elems, layout.piece_bytes, sum_pieces)
        return out


class _QRef:
    def quantize(self, x, packed, layout, residual=None, residual_out=None):
        _quantize.quantize_blocks(x, packed, layout, residual, residual_out)

    def dequantize(self, packed, layout, out, sum_pieces=False, base=None):
        return _quantize.dequantize_blocks(packed, layout, out, sum_pieces=sum_pieces, base=base)


def _q_run(q, layout, x, e, base, case):
    """Every output of one quantize + dequantize pass."""
    n, dev = x.numel(), x.device
    packed = torch.full((layout.total_bytes,), 0, dtype=torch.uint8, device=dev)
    e_out = torch.full((n,), 7.0, device=dev)
    with op_threads(case):
        q.quantize(x, packed, layout, e, e_out)
        alias = e.clone()  # residual_out aliasing the residual, as the hooks run it
        packed2 = torch.zeros_like(packed)
        q.quantize(x, packed2, layout, alias, alias)
        plain = torch.zeros_like(packed)  # no residual, none out
        q.quantize(x, plain, layout)
        m = min(n, layout.elems)
        cat = q.dequantize(packed, layout, torch.full((m,), 7.0, device=dev))
        minus = q.dequantize(packed, layout, torch.full((m,), 7.0, device=dev), base=base[:m])
        k = min(n, layout.piece_elems)
        summed = q.dequantize(packed, layout, torch.full((k,), 7.0, device=dev), sum_pieces=True)
        summed_minus = q.dequantize(packed, layout, torch.full((k,), 7.0, device=dev),
                                    sum_pieces=True, base=base[:k])
        in_place = base[:k].clone()  # base is out
        q.dequantize(packed, layout, in_place, sum_pieces=True, base=in_place)
    # the fused base - sum is the subtraction of the sum, bit for bit
    assert_bits(summed_minus, torch.sub(base[:k], summed), "base - sum vs torch.sub")
    assert_bits(in_place, summed_minus, "base - sum in place")
    return [packed, e_out, packed2, alias, plain, cat, minus, summed, summed_minus]


def _assert_same_outputs(got, want):
    """:func:`_q_run`'s outputs of a kernel against the reference's: bytes equal, floats
    bit for bit (nan where nan)."""
    names = ["packed", "e_out", "packed aliased", "e aliased",
             "packed plain", "cat", "base - D", "sum", "base - sum"]
    for name, a, b in zip(names, got, want):
        if a.dtype == torch.uint8:
            assert torch.equal(a.cpu(), b.cpu()), name
        else:
            assert_bits(a, b, name)


def _kernel_case(qext, device, bits, numel, block, pieces, piece_elems):
    """(layout, "large" or "small") of one kernel case, or a skip: no CUDA build, or the
    scalar bodies on a large case (the small ones cover them)."""
    if device == "cuda" and not qext.m.with_cuda():
        pytest.skip("extension built without CUDA")
    case = "large" if numel > 100_000 else "small"
    if case == "large" and qext.m._cpu_simd(-1) == 0 and device == "cpu":
        pytest.skip("ext_scalar: the small cases cover the scalar bodies")
    return _qlayout(numel, _whole_bytes(block, bits), pieces, piece_elems, bits), case


def _whole_bytes(block: int, bits: int) -> int:
    """``block``, doubled where 2-bit codes (four to a byte) would not fill whole bytes."""
    return block * 2 if bits == 2 and block % 4 else block


@pytest.fixture(params=["ext", "ext_scalar"])
def qext(request):
    m = _ext_module()
    if request.param == "ext":
        yield _QExt(m)
        return
    old = m._cpu_simd(-1)
    m._cpu_simd(0)
    try:
        yield _QExt(m)
    finally:
        m._cpu_simd(old)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel,block,pieces,piece_elems", QLAYOUTS)
def test_quantize_kernels_match_reference(qext, device, bits, numel, block, pieces, piece_elems,
                                          request):
    layout, case = _kernel_case(qext, device, bits, numel, block, pieces, piece_elems)
    x = _finite(numel, seed=50 + bits).to(device)
    e = (_finite(numel, seed=60) * 1e-3).to(device)
    base = _finite(layout.elems, seed=70).to(device)
    got = _q_run(qext, layout, x, e, base, case)
    want = _q_run(_QRef(), layout, x, e, base, case)
    _assert_same_outputs(got, want)
    if numel:
        assert torch.isfinite(got[1]).all() and torch.isfinite(got[5]).all()  # never NaN


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel,block,pieces,piece_elems", QLAYOUTS)
def test_quantize_of_a_change_is_delta_then_quantize(qext, device, bits, numel, block, pieces,
                                                     piece_elems):
    """``minus=``: the codes and residual of ``(x - minus) * scale (+ residual)`` are those
    of the change written out by ``delta`` and then quantized, in the kernels (vector and
    scalar bodies, residual aliased or not) as in the reference, bit for bit."""
    layout, case = _kernel_case(qext, device, bits, numel, block, pieces, piece_elems)
    x = _finite(numel, seed=90 + bits).to(device)
    minus = (x + _finite(numel, seed=91) * 1e-2).to(device)
    e = (_finite(numel, seed=92) * 1e-4).to(device)
    scale = 1.0 / 3.0  # rounded to float32, as the delta kernel rounds it
    change = _fallback.delta(x, [minus], torch.empty_like(x), scale)
    for residual in (None, e):
        want, want_e = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device), None
        if residual is not None:
            want_e = residual.clone()
        _quantize.quantize_blocks(change, want, layout, want_e, want_e)
        for impl in ("kernel", "reference"):
            got = torch.zeros_like(want)  # the kernels leave the padding bytes as they are
            got_e = None if residual is None else residual.clone()
            with op_threads(case):
                if impl == "kernel":
                    qext.m.quantize_blocks(x, got_e, got, got_e, layout.bits, layout.block_size,
                                           layout.pieces, layout.piece_elems, layout.piece_bytes,
                                           minus, scale)
                else:
                    _quantize.quantize_blocks(x, got, layout, got_e, got_e, minus, scale)
            assert torch.equal(got.cpu(), want.cpu()), (impl, residual is None)
            if residual is not None:
                assert_bits(got_e, want_e, f"{impl} residual")
    if numel:  # the change differs from x: the option is not ignored
        plain = torch.zeros_like(want)
        _quantize.quantize_blocks(x, plain, layout)
        assert not torch.equal(plain, want)


def test_quantize_of_a_change_through_ops():
    """``ops.quantize_blocks(..., minus=, scale=)``: the extension (float32) and the
    reference (float64) against the change computed here; bad ``minus`` refused."""
    layout = ops.QuantLayout.for_bucket(500, 2, 16, 4)
    for dt in (torch.float32, torch.float64):
        x = _finite(500, seed=93).to(dt)
        minus = x + _finite(500, seed=94).to(dt)
        r = torch.zeros(500, dtype=dt)
        got = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        ops.quantize_blocks(x, got, layout, residual=r, residual_out=r, minus=minus, scale=0.5)
        want, wr = torch.zeros_like(got), torch.zeros(500, dtype=dt)
        _quantize.quantize_blocks((x - minus) * 0.5, want, layout, wr, wr)
        assert torch.equal(got, want) and torch.equal(r, wr), dt
    x = torch.zeros(500)
    with pytest.raises(ValueError, match="quantize_blocks: minus has 499 elements but x has 500"):
        ops.quantize_blocks(x, got, layout, minus=torch.zeros(499))
    with pytest.raises(TypeError, match="quantize_blocks: minus has dtype torch.float64"):
        ops.quantize_blocks(x, got, layout, minus=torch.zeros(500, dtype=torch.float64))
    with pytest.raises(TypeError, match="quantize_blocks: scale must be a Python float"):
        ops.quantize_blocks(x, got, layout, minus=x, scale=torch.tensor(0.5))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=str)
def test_quantize_kernels_keep_nan_and_inf(qext, device, bits, bad):
    """A block holding nan or inf decodes to nan in every value, in the kernels (vector and
    scalar bodies) as in the reference, bit for bit; the other blocks are untouched."""
    if device == "cuda" and not qext.m.with_cuda():
        pytest.skip("extension built without CUDA")
    layout = _qlayout(300, 32, 2, None, bits)  # 5 blocks of 32 per piece
    x = _finite(300, seed=80).to(device)
    x[3] = bad         # in an 8-value group of the vector body
    x[159] = bad       # the last value of a block (and of piece 0)
    e = (_finite(300, seed=81) * 1e-3).to(device)
    e[200] = bad       # in the residual only
    base = _finite(layout.elems, seed=82).to(device)
    got = _q_run(qext, layout, x, e, base, "small")
    want = _q_run(_QRef(), layout, x, e, base, "small")
    _assert_same_outputs(got, want)
    decoded = got[5].cpu()  # piece 0 holds values 0..159, piece 1 values 160..299
    blocks = [(0, 32), (128, 160), (192, 224)]  # the blocks holding x[3], x[159], e[200]
    for lo, hi in blocks:
        assert decoded[lo:hi].isnan().all(), (lo, hi)
        assert got[1][lo:hi].isnan().all(), (lo, hi)  # the residual keeps it too
    bad_at = torch.zeros(300, dtype=torch.bool)
    for lo, hi in blocks:
        bad_at[lo:hi] = True
    assert torch.isfinite(decoded[~bad_at]).all()


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel,block,pieces,piece_elems", QLAYOUTS)
def test_payload_bytes_are_the_payload_views_bytes(bits, numel, block, pieces, piece_elems):
    layout = _qlayout(numel, _whole_bytes(block, bits), pieces, piece_elems, bits)
    packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    for n in {numel, max(numel - 1, 0), numel // 2}:
        assert layout.payload_bytes(n) == sum(t.numel() for t in layout.payload(packed, n)), n


def test_quantize_reference_semantics():
    """The reference against the formulas of its docstring, written out for one block."""
    layout = ops.QuantLayout(bits=4, block_size=4, pieces=2, piece_elems=4)
    x = torch.tensor([0.7, -0.35, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0])
    packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    e_out = torch.empty(8)
    ops.quantize_blocks(x, packed, layout, residual_out=e_out)
    s = 0.7 * torch.tensor(1 / 7, dtype=torch.float32)
    q = torch.tensor([7.0, -4.0, 1.0, 0.0])  # -0.35 / s = -3.5: half to even
    assert torch.equal(layout.scales(packed)[:, 0], torch.stack([s, torch.tensor(0.0)]))
    assert layout.codes(packed).tolist() == [[(8 + 7) | ((8 - 4) << 4), (8 + 1) | (8 << 4)],
                                             [0x88, 0x88]]
    assert_bits(e_out[:4], x[:4] - q * s, "residual")
    assert torch.equal(e_out[4:], torch.zeros(4))  # an all-zero block: scale 0, no NaN
    assert_bits(ops.dequantize_blocks(packed, layout, torch.empty(8)),
                torch.cat([q * s, torch.zeros(4)]), "dequantize")
    assert_bits(ops.dequantize_blocks(packed, layout, torch.empty(4), sum_pieces=True),
                q * s, "sum")


def test_quantize_float64_and_routing(monkeypatch):
    layout = ops.QuantLayout.for_bucket(100, 2, 16, 8)
    x = torch.linspace(-1, 1, 100, dtype=torch.float64)
    packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    e_out = torch.empty_like(x)
    ops.quantize_blocks(x, packed, layout, residual_out=e_out)  # float64: the reference
    d = ops.dequantize_blocks(packed, layout, torch.empty(100, dtype=torch.float64))
    assert torch.equal(d + e_out, x) and e_out.abs().max() <= 1 / 254 * (1 + 2**-14)
    m = _ext.load_extension()
    f32 = [torch.empty(3), torch.empty(3, dtype=torch.uint8)]
    assert (ops._quant_impl(f32) is m) if m is not None else ops._quant_impl(f32) is None
    assert ops._quant_impl([torch.empty(3, dtype=torch.float64)]) is None


def _bad_quant_calls():
    L = ops.QuantLayout.for_bucket(10, 1, 4, 8)
    pk = torch.zeros(L.total_bytes, dtype=torch.uint8)
    V, T = ValueError, TypeError
    f64 = torch.float64
    return {
        "x-dtype": (lambda: ops.quantize_blocks(torch.zeros(10, dtype=torch.half), pk, L), T,
                    "quantize_blocks: x has dtype torch.float16; expected float32 or float64"),
        "x-size": (lambda: ops.quantize_blocks(torch.zeros(13), pk, L), V,
                   "quantize_blocks: x has 13 elements but the layout holds 12"),
        "packed-size": (lambda: ops.quantize_blocks(torch.zeros(10), pk[:-1], L), V,
                        "quantize_blocks: packed has 23 bytes but the layout needs 24"),
        "packed-dtype": (lambda: ops.quantize_blocks(torch.zeros(10), pk.view(torch.int8), L), T,
                         "quantize_blocks: packed has dtype torch.int8; expected uint8"),
        "residual-size": (lambda: ops.quantize_blocks(torch.zeros(10), pk, L,
                                                      residual=torch.zeros(9)),
                          V, "quantize_blocks: residual has 9 elements but x has 10"),
        "residual-dtype": (lambda: ops.quantize_blocks(torch.zeros(10), pk, L,
                                                       residual_out=torch.zeros(10, dtype=f64)),
                           T, "quantize_blocks: residual_out has dtype torch.float64; "
                              "expected float32"),
        "layout": (lambda: ops.quantize_blocks(torch.zeros(10), pk, (8, 4)), T,
                   "quantize_blocks: layout must be a QuantLayout, got tuple"),
        "out-size": (lambda: ops.dequantize_blocks(pk, L, torch.zeros(13)), V,
                     "dequantize_blocks: out has 13 elements but the layout holds 12"),
        "base-size": (lambda: ops.dequantize_blocks(pk, L, torch.zeros(4), sum_pieces=True,
                                                    base=torch.zeros(3)), V,
                      "dequantize_blocks: base has 3 elements but out has 4"),
        "strided-out": (lambda: ops.dequantize_blocks(pk, L, torch.zeros(20)[::2]), V,
                        "dequantize_blocks: out must be a contiguous 1-D tensor"),
    }


@pytest.mark.parametrize("name", list(_bad_quant_calls()))
def test_quantize_errors(name):
    call, exc, msg = _bad_quant_calls()[name]
    with pytest.raises(exc) as got:
        call()
    assert str(got.value).startswith(msg), str(got.value)


def test_quantize_binding_refuses_bad_layouts():
    m = _ext_module()
    pk = torch.zeros(16, dtype=torch.uint8)
    x = torch.zeros(10)
    with pytest.raises(RuntimeError, match="bad layout"):  # piece_bytes that does not add up
        m.quantize_blocks(x, None, pk, None, 8, 4, 1, 12, 16)
    with pytest.raises(RuntimeError, match="bad layout"):  # odd block
        m.quantize_blocks(x, None, torch.zeros(20, dtype=torch.uint8), None, 8, 3, 1, 12, 20)
    with pytest.raises(RuntimeError, match="bad layout"):  # more values than the payload holds
        m.dequantize_blocks(torch.zeros(32, dtype=torch.uint8), None, torch.zeros(13),
                            8, 4, 1, 12, 32, False)
    with pytest.raises(RuntimeError):
        m.quantize_blocks(x.double(), None, pk, None, 8, 4, 1, 12, 24)
