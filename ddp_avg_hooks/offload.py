"""``OffloadedBucket``: a bucket that keeps its anchor and hook memory in host memory.

With ``register_averaging_hook(..., offload_state=True)`` every bucket keeps its anchor,
the half-precision hooks' residuals (``bucket.new_state()``) and the outer optimizer's
parameter and state (``hooks.outer_optimizer``) on the CPU, in pinned memory when the
parameters are on CUDA. A round copies them in and out one bucket at a time: each op
that needs the anchor or a residual copies that bucket's part to the parameters' device,
runs the same op as a device-resident bucket, and copies back what it wrote. The
results are bit for bit those of keeping the state on the device: the same ops run on
the same values (the outer optimizer then steps on the CPU, which for SGD's elementwise
arithmetic gives the device's bits).

What the device holds: between rounds, nothing but the parameters; during a round, the
half hooks run one bucket at a time (they wait for each bucket's all-reduce and keep
its result in host memory), so about two buckets' worth (``bucket_cap_mb``) at a time.
Hooks that read ``bucket.anchor()`` itself (PowerSGD, the 8/4-bit hooks, your own) get a
device copy that lives until the round is written back; their residuals stay on the
device.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.offload import OffloadedBucket
    >>> ps = [torch.nn.Parameter(torch.ones(3))]
    >>> b = OffloadedBucket(0, ps, is_last=True, keep_anchor=True)
    >>> b.state_device, b._stored_anchor().tolist()
    (device(type='cpu'), [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import torch

from . import ops
from .bucket import ParamBucket, split_like


class OffloadedBucket(ParamBucket):
    """A :class:`~ddp_avg_hooks.ParamBucket` whose state lives in host memory (see the module)."""

    offloaded = True

    def __init__(self, index: int, params, *, is_last: bool, keep_anchor: bool = False) -> None:
        super().__init__(index, params, is_last=is_last, keep_anchor=False)
        self.state_device = torch.device("cpu")
        self._staged: torch.Tensor | None = None  # anchor() on the device, for this round
        if keep_anchor:
            self._anchor = self.new_state()
            self._reset_anchor()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # a fresh copy even when the state already is on the parameters' device (a CPU
        # run), so the copies in and out are the same code on every device
        return t.to(self.device, non_blocking=t.is_pinned(), copy=True)

    def anchor(self) -> torch.Tensor:
        """A copy of the anchor on the parameters' device, made at the first call of a
        round and kept until the round is written back."""
        stored = self._stored_anchor()
        if self._staged is None:
            self._staged = self._to_device(stored)
        return self._staged

    def _anchor_for_op(self) -> torch.Tensor:
        return self._staged if self._staged is not None else self._to_device(self._stored_anchor())

    def _state_for_op(self, t: torch.Tensor) -> torch.Tensor:
        return self._to_device(t) if t.device == self.state_device else t

    def _commit_state(self, stored: torch.Tensor, used: torch.Tensor) -> None:
        if used is not stored:
            stored.copy_(used)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A round's result where the parameters are (the outer optimizer's is in host memory)."""
        t = t.reshape(-1)
        return t if t.device == self.device else self._to_device(t)

    def _start_round(self, delta_scale: float = 1.0, *, overlapped: bool = False) -> None:
        self._staged = None
        super()._start_round(delta_scale, overlapped=overlapped)

    @torch.no_grad()
    def _write_back(self, values: torch.Tensor) -> None:
        ops.apply_(self._on_device(values), self._params)
        self._reset_anchor()
        self._staged = None

    @torch.no_grad()
    def _write_back_delta(self, change: torch.Tensor) -> None:
        super()._write_back_delta(self._on_device(change))
        self._staged = None

    @torch.no_grad()
    def _write_back_with_progress(self, values: torch.Tensor, mixing: float | None = None) -> None:
        super()._write_back_with_progress(self._on_device(values), mixing)
        self._staged = None

    @torch.no_grad()
    def _reset_anchor(self) -> None:
        # parameter by parameter into views of the host anchor: no device copy of the bucket
        if self._anchor is not None:
            for a, p in zip(split_like(self._anchor, self._params), self._params):
                a.copy_(p)

    def _load_state_dict(self, saved: dict) -> None:
        self._staged = None
        super()._load_state_dict(saved)
