"""``ZeroCopyBucket``: a bucket whose parameters are views of its own flat buffer.

With ``register_averaging_hook(..., zero_copy=True)`` every bucket, once, at
registration, copies its parameters into one flat tensor and makes each parameter a view
of it (``p.data = flat[offset:offset + p.numel()].view(p.shape)``). What changes for the
user: each parameter's ``data_ptr()`` (once, at registration), and its memory format,
which becomes contiguous (row-major). The ``Parameter`` objects stay the same, so the
optimizer, its state and DDP keep working.

An exact round then runs the collective on the parameters' own storage: ``buffer()`` *is*
the parameters, a result that is that storage is not copied back, and the bucket keeps
no model-size buffer. Hooks that write a result of their own (``workspace()``: the
compressed hooks) get a separate scratch, so they never overwrite the parameters before
their result is checked.

Failure semantics: checks that need to see a result before anything changes
(``check_finite=True``) make ``buffer()`` a copy again, so a rejected round changes
nothing. Without them, what a hook does to ``buffer()`` it does to the parameters: the
built-in exact hook divides and all-reduces in place, so a collective that fails midway
(a peer died) leaves the buckets whose collectives had started partly reduced, as any
in-place all-reduce does; resume from a checkpoint (:mod:`ddp_avg_hooks.checkpoint`).
Hooks that write their result into ``workspace()`` (the compressed ones) change nothing
when they fail. Overlapped rounds need the parameters free during a round, so
``zero_copy=True`` and ``overlap=True`` exclude each other.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.zero_copy import ZeroCopyBucket
    >>> ps = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(3))]
    >>> b = ZeroCopyBucket(0, ps, is_last=True)
    >>> ps[1].data_ptr() == b.buffer().data_ptr() + 4 * 4  # a view of the bucket's storage
    True
"""

from __future__ import annotations

import torch

from . import ops
from .bucket import ParamBucket, split_like


class ZeroCopyBucket(ParamBucket):
    """A :class:`~ddp_avg_hooks.ParamBucket` over parameters that live in its buffer.

    Args:
        in_place: rounds work on the parameters' storage (``False``: ``buffer()`` is a
            copy, for checks that must see a result before it is written).
    """

    def __init__(self, index: int, params, *, is_last: bool, keep_anchor: bool = False,
                 in_place: bool = True) -> None:
        super().__init__(index, params, is_last=is_last, keep_anchor=False)
        with torch.no_grad():
            ops.flatten(self._params, self._buffer)
            for p, view in zip(self._params, split_like(self._buffer, self._params)):
                p.data = view
        self._in_place = in_place
        self._copy: torch.Tensor | None = None  # buffer() when not in place
        self._work: torch.Tensor | None = None  # workspace(): never the parameters
        if keep_anchor:
            self._anchor = self._buffer.clone()

    def _scratch_buffer(self, which: str) -> torch.Tensor:
        t = getattr(self, which)
        if t is None:
            t = torch.empty_like(self._buffer)
            setattr(self, which, t)
        return t

    def buffer(self) -> torch.Tensor:
        if self._in_place:
            return self._buffer
        copy = self._scratch_buffer("_copy")
        if not self._loaded:
            copy.copy_(self._buffer)
            self._loaded = True
        return copy

    def _scaled_buffer(self, scale: float) -> torch.Tensor:
        out = self.buffer()
        return out if scale == 1.0 else out.mul_(scale)

    def workspace(self) -> torch.Tensor:
        self._loaded = True
        return self._scratch_buffer("_work")

    def _load_parameters(self) -> torch.Tensor:
        return self._buffer

    @torch.no_grad()
    def _write_back(self, values: torch.Tensor) -> None:
        values = values.reshape(-1)
        if values.data_ptr() != self._buffer.data_ptr():
            self._buffer.copy_(values)
        if self._anchor is not None:
            self._anchor.copy_(self._buffer)
