"""What the round engine calls on a bucket: loading, write-back, anchors, checkpoints.

Hooks never call these; :class:`~ddp_avg_hooks.ParamBucket` inherits them. Every access
to the anchor or to hook memory outside a hook goes through three small methods
(``_anchor_for_op``, ``_state_for_op``, ``_commit_state``), which a bucket that keeps its
state elsewhere (``offload.OffloadedBucket``: in host memory) overrides.
"""

from __future__ import annotations

import torch

from . import ops


def split_like(flat: torch.Tensor, params) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params``, in order."""
    out, offset = [], 0
    for p in params:
        out.append(flat[offset : offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out


class BucketRounds:
    """The round engine's side of a :class:`~ddp_avg_hooks.ParamBucket` (see the module)."""

    # --- where the state lives: overridden by buckets that keep it off the device ------
    def _anchor_for_op(self) -> torch.Tensor:
        """The anchor as an op on the parameters' device reads it."""
        return self.anchor()

    def _state_for_op(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (anchor or hook memory) where an op on the parameters' device can use it."""
        return t

    def _commit_state(self, stored: torch.Tensor, used: torch.Tensor) -> None:
        """Keep what an op wrote into ``used`` (from :meth:`_state_for_op` of ``stored``)."""

    def _stored_anchor(self) -> torch.Tensor:
        """The anchor where it is kept (raises like ``anchor()`` without one)."""
        if self._anchor is None:
            self.anchor()
        return self._anchor

    @torch.no_grad()
    def _load_parameters(self) -> torch.Tensor:
        """Copy the live parameters into :meth:`buffer` and return it."""
        self._loaded = True
        return ops.flatten(self._params, self._buffer)

    def _start_round(self, delta_scale: float = 1.0, *, overlapped: bool = False) -> None:
        """Mark :meth:`buffer` stale: the next call copies the parameters again.

        With ``delta_scale`` != 1, :meth:`buffer` and :meth:`delta` show the change since
        the anchor scaled by it (this rank's weight in a weighted average) until the
        next round starts; the parameters themselves are not touched. ``overlapped``:
        the round runs while training goes on (hooks must not wait for it).
        """
        if delta_scale != 1.0 and self._anchor is None:
            raise RuntimeError(f"bucket {self._index}: a weighted round needs an anchor")
        self._loaded = False
        self._delta_scale = delta_scale
        self._overlapped = overlapped
        self._result_is_delta = False
        self._deferred = []

    def _take_deferred(self) -> list:
        """The calls the hook deferred in this round (see ``defer``); later ones run at once."""
        deferred, self._deferred = self._deferred or [], None
        return deferred

    @torch.no_grad()
    def _write_back(self, values: torch.Tensor) -> None:
        """Copy ``values`` into the parameters in place (and into the anchor, if kept)."""
        ops.apply_(values.reshape(-1), self._params, self._anchor)

    @torch.no_grad()
    def _write_back_delta(self, change: torch.Tensor) -> None:
        """``params <- anchor - change`` in place, and the anchor follows (chunked)."""
        anchor = self._anchor_for_op()
        ops.apply_delta_(anchor, change.reshape(-1), self._params)
        self._commit_state(self._anchor, anchor)

    @torch.no_grad()
    def _new_values(self, change: torch.Tensor) -> torch.Tensor:
        """``anchor - change`` in :meth:`workspace`, rounded as :meth:`_write_back_delta` does."""
        out, change = self.workspace(), change.reshape(-1)
        if self.dtype == torch.float32 and change.dtype != torch.float64:
            out.copy_(change)  # exact widening, then a same-dtype subtraction
            return torch.sub(self.anchor(), out, out=out)
        ct = torch.float64 if torch.float64 in (self.dtype, change.dtype) else torch.float32
        return out.copy_(self.anchor().to(ct) - change.to(ct))

    @torch.no_grad()
    def _snapshot_launch(self) -> None:
        """Remember the parameters as an overlapped round begins (one copy, kept)."""
        if self._launch is None:
            self._launch = self._empty()
        ops.flatten(self._params, self._launch)

    @torch.no_grad()
    def _write_back_with_progress(self, values: torch.Tensor, mixing: float | None = None) -> None:
        """Apply an overlapped round; the anchor becomes ``values`` (identical on every rank).

        ``mixing=None``: ``params <- params + (values - params_at_launch)``, keeping the
        local progress made while the round was in flight. ``mixing=alpha``:
        ``params <- alpha * params + (1 - alpha) * values`` (Streaming DiLoCo's merge).
        """
        values = values.reshape(-1)
        if mixing is not None:
            torch._foreach_lerp_(self._params, split_like(values, self._params), 1.0 - mixing)
        else:
            correction = self._launch.neg_().add_(values)
            torch._foreach_add_(self._params, split_like(correction, self._params))
        if self._anchor is not None:
            self._anchor.copy_(values)

    def _reset_anchor(self) -> None:
        """Make the current parameters the anchor (a no-op without anchors)."""
        if self._anchor is not None:
            ops.flatten(self._params, self._anchor)

    def _take_bytes_sent(self) -> int:
        sent, self._bytes_sent = self._bytes_sent, 0
        return sent

    def _state_dict(self) -> dict:
        """Anchor (or ``None``) and hook memory, cloned: this bucket's part of a checkpoint."""
        return {"anchor": None if self._anchor is None else self._anchor.clone(),
                "memory": {k: v.clone() for k, v in self._memory.items()}}

    def _check_state(self, saved: dict) -> None:
        if self._anchor is not None and saved["anchor"] is None:
            raise ValueError(
                f"load_state_dict: bucket {self._index} keeps an anchor but the checkpoint "
                "has none (was it saved by a handle without keep_anchor?)"
            )

    def _load_state_dict(self, saved: dict) -> None:
        """Restore what :meth:`_state_dict` saved (checked first by :meth:`_check_state`)."""
        if self._anchor is not None:
            self._anchor.copy_(saved["anchor"])
        self._memory.clear()
        self._memory.update({k: self._state_copy(v) for k, v in saved["memory"].items()})

    def _state_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` where this bucket keeps its state (``state_device``)."""
        out = self.new_state(t.dtype, numel=t.numel()).view(t.shape)
        return out.copy_(t)

    def _layout(self) -> tuple:
        """(device type, dtype, shapes): what must agree across ranks."""
        return (self.device.type, str(self.dtype), tuple(tuple(p.shape) for p in self._params))

