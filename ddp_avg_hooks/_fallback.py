"""Bucket copy operations in plain PyTorch: the readable reference for ``ops``.

Every op here has a twin in the C++ extension (``csrc/``) with the same signature,
the same results bit for bit and the same error types. The rules both follow:

* A flat buffer holds the parameters back to back, each in its *logical* (row-major)
  order, whatever its memory format: ``flat[off:off + p.numel()].view(p.shape)``.
* Arithmetic runs in float32 (float64 when any tensor involved is float64) and the
  result is rounded once to the output dtype, to nearest-even, as ``Tensor.to`` does.
* Supported dtypes: float32, float16, bfloat16, float64. All tensors on one device.
* Bad arguments raise ``ValueError`` (sizes, layout, devices) or ``TypeError`` (dtypes).

Example:
    >>> import torch
    >>> from ddp_avg_hooks import _fallback as F
    >>> ps = [torch.ones(2, 2), torch.full((3,), 2.0)]
    >>> flat = torch.empty(7, dtype=torch.float16)
    >>> F.flatten(ps, flat, scale=0.5).tolist()
    [0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_dtype(t: torch.Tensor, what: str, op: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: {what} has dtype {t.dtype}; supported dtypes are float32, float16, "
            "bfloat16 and float64"
        )


def _check_flat(flat: torch.Tensor, params: Sequence[torch.Tensor], what: str, op: str) -> None:
    """Checks shared by every op: a contiguous 1-D buffer that fits ``params`` exactly."""
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(flat).__name__}")
    _check_dtype(flat, what, op)
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError(
            f"{op}: {what} must be a contiguous 1-D tensor, got shape {tuple(flat.shape)} "
            f"with strides {flat.stride()}"
        )
    total = 0
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{op}: params[{i}] must be a torch.Tensor, got {type(p).__name__}")
        _check_dtype(p, f"params[{i}]", op)
        if p.device != flat.device:
            raise ValueError(
                f"{op}: params[{i}] is on {p.device} but {what} is on {flat.device}; "
                "put all tensors of one call on one device"
            )
        total += p.numel()
    if total != flat.numel():
        raise ValueError(
            f"{op}: {what} has {flat.numel()} elements but the parameters hold {total}; "
            "the buffer must have exactly sum(p.numel() for p in params) elements"
        )


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _views(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    out, off = [], 0
    for p in params:
        n = p.numel()
        out.append(flat[off : off + n].view(p.shape))
        off += n
    return out


@torch.no_grad()
def flatten(
    params: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``out <- cat([p.flatten() for p in params]) * scale``, cast to ``out.dtype``; returns ``out``."""
    _check_flat(out, params, "out", "flatten")
    views = _views(out, params)
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
    _check_flat(flat, params, "flat", "unflatten_")
    for v, p in zip(_views(flat, params), params):
        p.copy_(v)


@torch.no_grad()
def delta(
    anchor: torch.Tensor,
    params: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """``out <- (anchor - flatten(params)) * scale``, cast to ``out.dtype``; returns ``out``."""
    _check_flat(anchor, params, "anchor", "delta")
    _check_flat(out, params, "out", "delta")
    for a, p, o in zip(_views(anchor, params), params, _views(out, params)):
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
    _check_flat(flat, params, "flat", "apply_")
    if anchor is not None:
        _check_flat(anchor, params, "anchor", "apply_")
        for i, p in enumerate(params):
            if p.dtype != anchor.dtype:
                raise TypeError(
                    f"apply_: anchor has dtype {anchor.dtype} but params[{i}] has {p.dtype}; "
                    "the anchor must have the parameters' dtype"
                )
    for v, p in zip(_views(flat, params), params):
        p.copy_(v)
    if anchor is not None:
        for a, p in zip(_views(anchor, params), params):
            a.copy_(p)
