"""What the compressed-delta hooks share: options, error-feedback residuals, state checks.

The half-precision hooks (:mod:`.compress`) and the int8/int4 hooks (:mod:`.quantized`)
send the change since the last round and keep what their rounding lost, per bucket:

* with a state object (a :class:`DeltaState` subclass), the residuals live in the
  state, keyed by ``bucket.index()``, and its ``state_dict()`` saves them;
* with ``state=None`` or a ``ProcessGroup`` (as for DDP's stock hooks), error feedback
  is on with the default options and the residual lives in ``bucket.memory()``, which
  ``handle.state_dict()`` saves like the anchors.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.hooks import HalfDeltaState
    >>> from ddp_avg_hooks.bucket import ParamBucket
    >>> state = HalfDeltaState()
    >>> state.residual(ParamBucket(0, [torch.zeros(3)], is_last=True)).dtype
    torch.bfloat16
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .._checks import check_bool
from .._groups import check_group, or_world
from ..bucket import ParamBucket
from ._per_bucket import PerBucket


def load_residual(mine: torch.Tensor, saved: torch.Tensor) -> None:
    """Copy a saved residual into this state's (in this state's dtype)."""
    if mine.numel() != saved.numel():
        raise ValueError(f"it holds {mine.numel()} elements, the checkpoint {saved.numel()}")
    mine.copy_(saved)


class DeltaState:
    """Base of the compressed-delta hooks' states: a process group, error feedback on or
    off, and one residual per bucket (made by :meth:`new_residual`).

    Subclasses set ``owner`` (their name, for messages), implement :meth:`new_residual`
    and list their options in :meth:`settings`.
    """

    __slots__ = ("process_group", "error_feedback", "_residuals")
    owner = "DeltaState"

    def __init__(self, process_group: dist.ProcessGroup | None, error_feedback: bool) -> None:
        self.process_group = check_group(process_group, self.owner)
        self.error_feedback = check_bool("error_feedback", error_feedback, owner=self.owner)
        self._residuals: PerBucket[torch.Tensor] = PerBucket(
            self.owner, create=self.new_residual, save=torch.clone, load=load_residual,
            numel=torch.Tensor.numel)

    def new_residual(self, bucket: ParamBucket) -> torch.Tensor:
        """Zeros for ``bucket``'s residual, in this state's dtype and place."""
        raise NotImplementedError

    def residual(self, bucket: ParamBucket) -> torch.Tensor | None:
        """``bucket``'s residual (made on first use), or ``None`` without error feedback."""
        return self._residuals.get(bucket) if self.error_feedback else None

    def settings(self) -> dict:
        """The options, as plain values (what ``state_dict()`` saves beside the residuals)."""
        return {"error_feedback": self.error_feedback}

    def memory_tensors(self):
        yield from (("residuals", t) for _, t in self._residuals.items())

    def state_dict(self) -> dict:
        """This rank's residuals (``bucket.index() -> tensor``) and the options."""
        return {**self.settings(), "residuals": self._residuals.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore residuals saved by :meth:`state_dict` (before or after the first round)."""
        self.error_feedback = bool(state_dict["error_feedback"])
        self._residuals.load_state_dict(state_dict["residuals"])

    def __getstate__(self) -> dict:  # process groups do not pickle
        return self.state_dict()


def residual_in_bucket(bucket: ParamBucket, key: str,
                       create: Callable[[ParamBucket], torch.Tensor]) -> torch.Tensor:
    """The residual kept in ``bucket.memory()[key]`` (made on first use), so the handle
    checkpoints it: for a hook registered with ``state=None`` or a process group."""
    stored = bucket.memory().get(key)
    if stored is None:
        stored = bucket.memory()[key] = create(bucket)
    return stored


class DeltaHookFamily:
    """The parts of a family of delta hooks that depend only on its state class.

    Args:
        state_cls: the family's :class:`DeltaState` subclass.
        memory_key: where a stateless registration keeps the residual in ``bucket.memory()``.
        default_residual: ``default_residual(bucket)``, that residual's zeros.
        example: how to build a state, for messages.
    """

    def __init__(self, state_cls: type, memory_key: str,
                 default_residual: Callable[[ParamBucket], torch.Tensor], example: str) -> None:
        self.state_cls, self.memory_key = state_cls, memory_key
        self.default_residual, self.example = default_residual, example

    def validator(self, hook_name: str) -> Callable[[object], None]:
        """A hook's ``validate_state``: a state of the family, ``None`` or a process group."""
        def validate_state(state) -> None:
            if not isinstance(state, self.state_cls):
                check_group(state, hook_name, what="state", also=self.example)
        return validate_state

    def group_and_residual(self, state, bucket: ParamBucket):
        """(group, residual or ``None``) for one hook call."""
        if isinstance(state, self.state_cls):
            return or_world(state.process_group), state.residual(bucket)
        return or_world(state), residual_in_bucket(bucket, self.memory_key, self.default_residual)

    def settings(self, state) -> dict:
        """A hook's ``settings``: the state's options (the defaults for ``None`` or a group)."""
        return (state if isinstance(state, self.state_cls) else self.state_cls()).settings()

    def prepare_bucket(self, state, bucket: ParamBucket) -> None:
        """Make the residual at registration, so a fresh handle's ``state_dict()`` already
        has the structure a checkpoint loads into."""
        self.group_and_residual(state, bucket)
