"""Fused bucket copies: flatten, unflatten, delta and apply, with casting.

This module is the only one that knows where the ops come from. Each call is
validated once, here (``ValueError`` for sizes, layout and devices, ``TypeError`` for
dtypes), then routed, as ``torch.optim`` picks fused / foreach / for-loop kernels:

* ``"extension"``: the C++ extension (see ``_ext``), when it is loaded and every
  tensor is float32, float16 or bfloat16 on the CPU, or on CUDA when the extension
  was built with CUDA;
* ``"foreach"``: ``_fallback.foreach_*``, ``torch._foreach_*`` ops (float64, other
  foreach-capable devices, or no extension);
* ``"reference"``: the per-tensor loop of ``_fallback`` (tensor subclasses, devices
  without foreach kernels).

All three give identical results; the semantics are documented in ``_fallback``.
``backend()`` says whether the extension is in use. It is loaded (built the first
time, ~1 min; ``make ext`` does it ahead) on the first op call or ``backend()``, never
at import; ``DDP_AVG_HOOKS_DISABLE_EXT=1`` keeps it out. CPU calls of the extension
use ``torch.get_num_threads()`` threads.

Example:
    >>> import torch
    >>> from ddp_avg_hooks import ops
    >>> ps = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)]
    >>> ops.unflatten_(torch.arange(10.0), ps)
    >>> ps[1].tolist()
    [6.0, 7.0, 8.0, 9.0]
    >>> ops._route([torch.empty(10)], ps)  # float64 is not for the extension
    'foreach'
    >>> ops.backend() in ("extension", "fallback")
    True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType, SimpleNamespace

import torch

from . import _ext, _fallback

SUPPORTED_DTYPES = _fallback.SUPPORTED_DTYPES
_EXT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # subclasses go to the reference loop

_FOREACH = SimpleNamespace(
    flatten=_fallback.foreach_flatten,
    unflatten_=_fallback.foreach_unflatten_,
    delta=_fallback.foreach_delta,
    apply_=_fallback.foreach_apply_,
)


def backend() -> str:
    """``"extension"`` when the compiled ops are in use, else ``"fallback"``."""
    return "extension" if _ext.load_extension() is not None else "fallback"


def _as_list(params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    return params if isinstance(params, (list, tuple)) else list(params)


# ---------------------------------------------------------------- validation


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


# ---------------------------------------------------------------- routing


@functools.cache
def _foreach_devices() -> frozenset[str]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        devices = _get_foreach_kernels_supported_devices()
    except ImportError:  # a torch without the helper
        devices = ["cuda"]
    # on the CPU the foreach ops are per-tensor loops in C++: still fewer temporaries here
    return frozenset(["cpu", *devices])


def _route(flats: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> str:
    """``"extension"``, ``"foreach"`` or ``"reference"``: who runs a validated call.

    ``flats`` are the call's flat buffers (all on the parameters' device).
    """
    tensors = [*flats, *params]
    if not all(type(t) in _PLAIN_TYPES for t in tensors):
        return "reference"
    dev = flats[0].device.type
    ext = _ext.load_extension()
    if (
        ext is not None
        and (dev == "cpu" or (dev == "cuda" and ext.with_cuda()))
        and all(t.dtype in _EXT_DTYPES for t in tensors)
    ):
        return "extension"
    return "foreach" if dev in _foreach_devices() else "reference"


def _impl(
    flats: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> ModuleType | SimpleNamespace:
    route = _route(flats, params)
    if route == "extension":
        return _ext.load_extension()
    return _FOREACH if route == "foreach" else _fallback


# ---------------------------------------------------------------- the ops


def flatten(
    params: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``out <- cat([p.flatten() for p in params]) * scale``, cast to ``out.dtype``; returns ``out``."""
    params = _as_list(params)
    _check_flat(out, params, "out", "flatten")
    _impl((out,), params).flatten(params, out, scale)
    return out


def unflatten_(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``params`` in place, casting to each parameter's dtype."""
    params = _as_list(params)
    _check_flat(flat, params, "flat", "unflatten_")
    _impl((flat,), params).unflatten_(flat, params)


def delta(
    anchor: torch.Tensor,
    params: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """``out <- (anchor - flatten(params)) * scale``, cast to ``out.dtype``; returns ``out``."""
    params = _as_list(params)
    _check_flat(anchor, params, "anchor", "delta")
    _check_flat(out, params, "out", "delta")
    _impl((out, anchor), params).delta(anchor, params, out, scale)
    return out


def apply_(
    flat: torch.Tensor, params: Sequence[torch.Tensor], anchor: torch.Tensor | None = None
) -> None:
    """Write ``flat`` into ``params`` in place and, if given, into ``anchor``.

    The anchor receives exactly the values the parameters hold afterwards: ``flat``
    rounded to each parameter's dtype (the anchor must share the parameters' dtype).
    """
    params = _as_list(params)
    _check_flat(flat, params, "flat", "apply_")
    flats = (flat,)
    if anchor is not None:
        _check_flat(anchor, params, "anchor", "apply_")
        for i, p in enumerate(params):
            if p.dtype != anchor.dtype:
                raise TypeError(
                    f"apply_: anchor has dtype {anchor.dtype} but params[{i}] has {p.dtype}; "
                    "the anchor must have the parameters' dtype"
                )
        flats = (flat, anchor)
    _impl(flats, params).apply_(flat, params, anchor)


__all__ = ["backend", "flatten", "unflatten_", "delta", "apply_", "SUPPORTED_DTYPES"]
