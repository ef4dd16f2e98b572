"""Bucket copy operations in plain PyTorch: the reference loop and a ``torch._foreach_*`` tier.

``flatten``, ``unflatten_``, ``delta``, ``apply_``, ``feedback_cast``, ``apply_delta_``
and ``apply_progress_`` are the readable per-tensor reference; ``foreach_flatten`` ...
``foreach_apply_progress_`` compute the same thing with
``torch._foreach_*`` ops, through a small reused scratch buffer instead of temporaries.
The first four also have a twin in the C++ extension (``csrc/``); all give the same
results bit for bit, following these rules:

* A flat buffer holds the parameters back to back, each in its *logical* (row-major)
  order, whatever its memory format: ``flat[off:off + p.numel()].view(p.shape)``.
* Arithmetic runs in float32 (float64 when any tensor of the parameter's computation
  is float64) and the result is rounded once to the output dtype, to nearest-even,
  as ``Tensor.to`` does.
* Supported dtypes: float32, float16, bfloat16, float64. All tensors on one device.

The functions here do not check their arguments: ``ops`` validates every call once
(``ValueError`` for sizes, layout and devices, ``TypeError`` for dtypes) and then
picks one of the implementations.

Example:
    >>> import torch
    >>> from ddp_avg_hooks import _fallback as F
    >>> ps = [torch.ones(2, 2), torch.full((3,), 2.0)]
    >>> flat = torch.empty(7, dtype=torch.float16)
    >>> F.flatten(ps, flat, scale=0.5).tolist()
    [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
    >>> F.foreach_flatten(ps, torch.empty_like(flat), scale=0.5).equal(flat)
    True
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def split_like(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params``, back to back, in order."""
    out, off = [], 0
    for p in params:
        n = p.numel()
        out.append(flat[off : off + n].view(p.shape))
        off += n
    return out


# ---------------------------------------------------------------- reference


@torch.no_grad()
def flatten(
    params: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``out <- cat([p.flatten() for p in params]) * scale``, cast to ``out.dtype``; returns
    ``out``."""
    views = split_like(out, params)
    if scale is None:
        for v, p in zip(views, params):
            v.copy_(p)
        return out
    for v, p in zip(views, params):
        # out-of-place: p.to(...) is p itself when the dtype already matches
        v.copy_(p.to(_compute_dtype(p.dtype, out.dtype)) * scale)
    return out


@torch.no_grad()
def unflatten_(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``params`` in place, casting to each parameter's dtype."""
    for v, p in zip(split_like(flat, params), params):
        p.copy_(v)


@torch.no_grad()
def delta(
    anchor: torch.Tensor,
    params: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """``out <- (anchor - flatten(params)) * scale``, cast to ``out.dtype``; returns ``out``."""
    for a, p, o in zip(split_like(anchor, params), params, split_like(out, params)):
        ct = _compute_dtype(a.dtype, p.dtype, o.dtype)
        o.copy_((a.to(ct) - p.to(ct)) * scale)  # out-of-place: never touch anchor or p
    return out


@torch.no_grad()
def apply_(
    flat: torch.Tensor, params: Sequence[torch.Tensor], anchor: torch.Tensor | None = None
) -> None:
    """Write ``flat`` into ``params`` in place and, if given, into ``anchor``.

    The anchor receives exactly the values the parameters hold afterwards: ``flat``
    rounded to each parameter's dtype (the anchor must share the parameters' dtype).
    """
    for v, p in zip(split_like(flat, params), params):
        p.copy_(v)
    if anchor is not None:
        for a, p in zip(split_like(anchor, params), params):
            a.copy_(p)


@torch.no_grad()
def feedback_cast(anchor: torch.Tensor, params: Sequence[torch.Tensor], residual: torch.Tensor,
                  out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Error-feedback rounding of the scaled change: with ``x = (anchor - flatten(params))
    * scale + residual``, ``out <- x`` rounded to ``out.dtype`` and ``residual <- x - out``
    rounded to ``residual.dtype`` (what the rounding lost); returns ``out``."""
    for a, p, r, o in zip(split_like(anchor, params), params, split_like(residual, params),
                          split_like(out, params)):
        ct = _compute_dtype(a.dtype, p.dtype, r.dtype, o.dtype)
        x = (a.to(ct) - p.to(ct)) * scale + r.to(ct)
        o.copy_(x)
        r.copy_(x - o.to(ct))
    return out


@torch.no_grad()
def apply_delta_(anchor: torch.Tensor, change: torch.Tensor,
                 params: Sequence[torch.Tensor]) -> None:
    """``params <- anchor - change`` in place (rounded to each parameter's dtype), then
    ``anchor <- params``: a round whose result is the averaged change."""
    for a, c, p in zip(split_like(anchor, params), split_like(change, params), params):
        ct = _compute_dtype(a.dtype, c.dtype, p.dtype)
        p.copy_(a.to(ct) - c.to(ct))
        a.copy_(p)


@torch.no_grad()
def apply_progress_(values: torch.Tensor, launch: torch.Tensor, params: Sequence[torch.Tensor],
                    anchor: torch.Tensor | None = None) -> None:
    """An overlapped round's write: ``params <- params + (values - launch)``, the
    correction rounded to each parameter's dtype before the sum, which is rounded again;
    ``anchor <- values`` rounded to the parameters' dtype (when an anchor is given).
    ``launch`` is left as it is."""
    anchors = split_like(anchor, params) if anchor is not None else [None] * len(params)
    for v, at_launch, p, a in zip(split_like(values, params), split_like(launch, params),
                                  params, anchors):
        correction = (v.to(_compute_dtype(v.dtype, p.dtype)) - at_launch).to(p.dtype)
        ct = _compute_dtype(p.dtype)
        p.copy_(p.to(ct) + correction.to(ct))
        if a is not None:
            a.copy_(v)


# ---------------------------------------------------------------- foreach tier


def _groups(
    params: Sequence[torch.Tensor], *flats: torch.Tensor
) -> dict[torch.dtype, tuple[list[torch.Tensor], ...]]:
    """``{dtype: (params, views of flats[0], ...)}``, empty tensors left out.

    One group per parameter dtype: the compute dtype is fixed within a group, and
    CUDA's fused foreach kernels want one dtype per list.
    """
    views = [split_like(f, params) for f in flats]
    groups: dict[torch.dtype, tuple[list[torch.Tensor], ...]] = {}
    for i, p in enumerate(params):
        if p.numel() == 0:
            continue  # foreach ops reject empty lists; an empty tensor has nothing to do
        g = groups.get(p.dtype)
        if g is None:
            g = groups[p.dtype] = tuple([] for _ in range(1 + len(flats)))
        g[0].append(p)
        for lst, v in zip(g[1:], views):
            lst.append(v[i])
    return groups


# Elements per step on the CPU: each step runs its four foreach ops through one
# reused scratch buffer (4 MiB of float32, kept per thread and dtype) that stays in
# cache, so memory sees about what the extension moves; fresh full-size temporaries
# are what make the reference loop slow (extra passes, page faults). Smaller steps
# pay more per-call overhead.
_CPU_CHUNK = 1 << 20
_local = threading.local()


def _scratch(n: int, dtype: torch.dtype, device: torch.device, slot: int = 0) -> torch.Tensor:
    if device.type != "cpu":  # the caching allocator makes this cheap, and stream-safe
        return torch.empty(n, dtype=dtype, device=device)
    bufs = _local.__dict__.setdefault("bufs", {})  # one per thread: ops may run concurrently
    buf = bufs.get((dtype, slot))
    if buf is None or buf.numel() < n:
        buf = bufs[(dtype, slot)] = torch.empty(n, dtype=dtype)
    return buf[:n]


def _batches(limit: int, *lists: list[torch.Tensor]):
    """Aligned 1-D slices of the tensors of ``lists`` (equal numels at each index), in
    batches of at most ``limit`` elements: yields ``(slices of each list, numel)``."""
    batch, total = [[] for _ in lists], 0
    for ts in zip(*lists):
        flat = [t.reshape(-1) for t in ts]  # copies only a non-contiguous parameter
        n = flat[0].numel()
        for lo in range(0, n, limit):
            k = min(limit, n - lo)
            if total + k > limit:
                yield batch, total
                batch, total = [[] for _ in lists], 0
            for b, f in zip(batch, flat):
                b.append(f[lo : lo + k])
            total += k
    if total:
        yield batch, total


def _scaled(
    ct: torch.dtype,
    dst: list[torch.Tensor],
    first: list[torch.Tensor],
    minus: list[torch.Tensor] | None,
    scale: float,
) -> None:
    """``dst <- (first - minus) * scale`` (no ``minus`` when None), computed in ``ct``."""
    dev = dst[0].device
    limit = _CPU_CHUNK if dev.type == "cpu" else sum(t.numel() for t in dst)
    lists = (dst, first) if minus is None else (dst, first, minus)
    for (d, f, *m), n in _batches(limit, *lists):
        sc = split_like(_scratch(n, ct, dev), d)
        torch._foreach_copy_(sc, f)  # exact: ct holds every value of f's dtype
        if m:
            torch._foreach_sub_(sc, m[0])
        if scale != 1.0:  # x * 1.0 == x
            torch._foreach_mul_(sc, scale)
        torch._foreach_copy_(d, sc)  # the one rounding to the output dtype


@torch.no_grad()
def foreach_flatten(
    params: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """:func:`flatten` with ``torch._foreach_*`` ops."""
    for dt, (ps, vs) in _groups(params, out).items():
        if scale is None:
            torch._foreach_copy_(vs, ps)
        else:
            _scaled(_compute_dtype(dt, out.dtype), vs, ps, None, scale)
    return out


@torch.no_grad()
def foreach_unflatten_(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """:func:`unflatten_` with ``torch._foreach_copy_``."""
    for ps, vs in _groups(params, flat).values():
        torch._foreach_copy_(ps, vs)


@torch.no_grad()
def foreach_delta(anchor: torch.Tensor, params: Sequence[torch.Tensor], out: torch.Tensor,
                  scale: float = 1.0) -> torch.Tensor:
    """:func:`delta` with ``torch._foreach_*`` ops."""
    for dt, (ps, av, ov) in _groups(params, anchor, out).items():
        _scaled(_compute_dtype(anchor.dtype, dt, out.dtype), ov, av, ps, scale)
    return out


@torch.no_grad()
def foreach_apply_(
    flat: torch.Tensor, params: Sequence[torch.Tensor], anchor: torch.Tensor | None = None
) -> None:
    """:func:`apply_` with ``torch._foreach_copy_``."""
    flats = (flat,) if anchor is None else (flat, anchor)
    for ps, fv, *av in _groups(params, *flats).values():
        torch._foreach_copy_(ps, fv)
        if av:
            torch._foreach_copy_(av[0], ps)


def _chunk_limit(tensors: list[torch.Tensor]) -> int:
    return _CPU_CHUNK if tensors[0].device.type == "cpu" else _CPU_CHUNK * 16


@torch.no_grad()
def foreach_feedback_cast(anchor: torch.Tensor, params: Sequence[torch.Tensor],
                          residual: torch.Tensor, out: torch.Tensor,
                          scale: float = 1.0) -> torch.Tensor:
    """:func:`feedback_cast` with ``torch._foreach_*`` ops, in bounded chunks (no
    temporary the size of the bucket)."""
    for dt, (ps, av, rv, ov) in _groups(params, anchor, residual, out).items():
        ct = _compute_dtype(anchor.dtype, dt, residual.dtype, out.dtype)
        for (p, a, r, o), n in _batches(_chunk_limit(ps), ps, av, rv, ov):
            dev = p[0].device
            x = split_like(_scratch(n, ct, dev), p)
            torch._foreach_copy_(x, a)
            torch._foreach_sub_(x, p)
            if scale != 1.0:
                torch._foreach_mul_(x, scale)
            wide = split_like(_scratch(n, ct, dev, slot=1), p)
            torch._foreach_copy_(wide, r)  # exact widening: same-dtype ops from here on
            torch._foreach_add_(x, wide)
            torch._foreach_copy_(o, x)  # the rounding to the output dtype
            torch._foreach_copy_(wide, o)
            torch._foreach_sub_(x, wide)
            torch._foreach_copy_(r, x)
    return out


@torch.no_grad()
def foreach_apply_delta_(anchor: torch.Tensor, change: torch.Tensor,
                         params: Sequence[torch.Tensor]) -> None:
    """:func:`apply_delta_` with ``torch._foreach_*`` ops, in bounded chunks.

    The new values are computed into the anchor (it has the parameters' dtype, so they
    are exactly what the parameters receive), then copied into the parameters: a
    parameter is never written through a reshaped copy.
    """
    for dt, (ps, av, cv) in _groups(params, anchor, change).items():
        ct = _compute_dtype(anchor.dtype, change.dtype, dt)
        for (a, c), n in _batches(_chunk_limit(ps), av, cv):
            dev = a[0].device
            x = split_like(_scratch(n, ct, dev), a)
            widened = split_like(_scratch(n, ct, dev, slot=1), a)
            torch._foreach_copy_(x, a)
            torch._foreach_copy_(widened, c)  # same-dtype sub: the fast path on CPU
            torch._foreach_sub_(x, widened)
            torch._foreach_copy_(a, x)
        torch._foreach_copy_(ps, av)


@torch.no_grad()
def foreach_apply_progress_(values: torch.Tensor, launch: torch.Tensor,
                            params: Sequence[torch.Tensor],
                            anchor: torch.Tensor | None = None) -> None:
    """:func:`apply_progress_` with ``torch._foreach_*`` ops, in bounded chunks.

    The corrections are computed into the anchor (it has the parameters' dtype, so they
    are rounded as the parameters would round them), added to the parameters, and then
    the anchor takes ``values``: no temporary the size of the bucket. Without an anchor
    they are computed chunk by chunk into a scratch buffer of the parameters' dtype.
    """
    if anchor is None:
        if not all(p.is_contiguous() for p in params):  # a chunk of it would be a copy
            apply_progress_(values, launch, params)
            return
        for dt, (ps, vv, lv) in _groups(params, values, launch).items():
            ct, dev = _compute_dtype(values.dtype, dt), ps[0].device
            limit = _CPU_CHUNK if dev.type == "cpu" else sum(t.numel() for t in ps)
            for (pc, vc, lc), n in _batches(limit, ps, vv, lv):
                corr = split_like(_scratch(n, dt, dev, slot=1), pc)
                _scaled(ct, corr, vc, lc, 1.0)
                torch._foreach_add_(pc, corr)
        return
    for dt, (ps, vv, lv, av) in _groups(params, values, launch, anchor).items():
        _scaled(_compute_dtype(values.dtype, dt), av, vv, lv, 1.0)  # the corrections
        torch._foreach_add_(ps, av)
        torch._foreach_copy_(av, vv)
