"""Fused bucket copies: flatten, unflatten, delta and apply, with casting.

This module is the only one that knows where the ops come from: the C++ extension
when it is available (see ``_ext``), else the pure-PyTorch reference in
``_fallback``. Both give identical results and raise the same exception types;
``backend()`` says which one is in use. The semantics are documented in ``_fallback``.

The extension is loaded (built the first time, ~1 min; ``make ext`` does it ahead)
on the first op call or ``backend()``, never at import. It runs CPU tensors, and
CUDA tensors when it was built with CUDA, in float32, float16 and bfloat16; a call
that involves float64 or another device goes to the fallback. CPU calls use
``torch.get_num_threads()`` threads. ``DDP_AVG_HOOKS_DISABLE_EXT=1`` forces the fallback.

Example:
    >>> import torch
    >>> from ddp_avg_hooks import ops
    >>> ps = [torch.zeros(2, 3), torch.zeros(4)]
    >>> ops.unflatten_(torch.arange(10.0), ps)
    >>> ps[1].tolist()
    [6.0, 7.0, 8.0, 9.0]
    >>> ops.backend() in ("extension", "fallback")
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _ext, _fallback

SUPPORTED_DTYPES = _fallback.SUPPORTED_DTYPES


def backend() -> str:
    """``"extension"`` when the compiled ops are in use, else ``"fallback"``."""
    return "extension" if _ext.load_extension() is not None else "fallback"


def _as_list(params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    return params if isinstance(params, (list, tuple)) else list(params)


def flatten(
    params: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``out <- cat([p.flatten() for p in params]) * scale``, cast to ``out.dtype``; returns ``out``."""
    params = _as_list(params)
    ext = _ext.load_extension()
    if ext is not None and ext.flatten(params, out, scale):
        return out
    return _fallback.flatten(params, out, scale)


def unflatten_(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``params`` in place, casting to each parameter's dtype."""
    params = _as_list(params)
    ext = _ext.load_extension()
    if ext is not None and ext.unflatten_(flat, params):
        return None
    return _fallback.unflatten_(flat, params)


def delta(
    anchor: torch.Tensor,
    params: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """``out <- (anchor - flatten(params)) * scale``, cast to ``out.dtype``; returns ``out``."""
    params = _as_list(params)
    ext = _ext.load_extension()
    if ext is not None and ext.delta(anchor, params, out, scale):
        return out
    return _fallback.delta(anchor, params, out, scale)


def apply_(
    flat: torch.Tensor, params: Sequence[torch.Tensor], anchor: torch.Tensor | None = None
) -> None:
    """Write ``flat`` into ``params`` in place and, if given, into ``anchor``.

    The anchor receives exactly the values the parameters hold afterwards (see
    ``_fallback.apply_``).
    """
    params = _as_list(params)
    ext = _ext.load_extension()
    if ext is not None and ext.apply_(flat, params, anchor):
        return None
    return _fallback.apply_(flat, params, anchor)


__all__ = ["backend", "flatten", "unflatten_", "delta", "apply_", "SUPPORTED_DTYPES"]
