"""``AveragingOptions``: every setting of a registration, checked in one place.

:func:`~ddp_avg_hooks.register_averaging_hook` builds one from its arguments; nothing
else reads or checks them.

Example:
    >>> from ddp_avg_hooks.options import AveragingOptions
    >>> AveragingOptions(period=4, overlap=True).wants_anchor(hook_needs_anchor=False)
    True
    >>> AveragingOptions(optimizer_state="average")
    Traceback (most recent call last):
    ...
    ValueError: optimizer_state='average' needs the optimizer: pass optimizer=... as well
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ._checks import check_bool, check_int
from ._groups import is_group
from .schedules import EverySeconds, PeriodSchedule, as_schedule

OPTIMIZER_STATE_POLICIES = ("keep", "average", "reset")
_FLAGS = ("check_finite", "verify", "overlap", "track_consensus", "average_buffers", "zero_copy",
          "offload_state")


@dataclasses.dataclass
class AveragingOptions:
    """The arguments of :func:`~ddp_avg_hooks.register_averaging_hook`, validated.

    ``schedule`` is ``period`` as a schedule object.
    """

    period: int | PeriodSchedule = 1
    warmup_steps: int = 0
    bucket_cap_mb: float = 25.0
    optimizer: torch.optim.Optimizer | None = None
    keep_anchor: bool | None = None
    process_group: object = None
    check_finite: bool = False
    verify: bool = False
    overlap: bool = False
    track_consensus: bool = False
    average_buffers: bool = False
    optimizer_state: str = "keep"
    on_round: Callable | None = None
    zero_copy: bool = False
    offload_state: bool = False
    fragments: int = 1
    mixing: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.period, PeriodSchedule):
            check_int("period", self.period, 1)
        check_int("warmup_steps", self.warmup_steps, 0)
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not isinstance(cap, (int, float)):
            raise TypeError(f"bucket_cap_mb must be a number, got {type(cap).__name__}")
        if not cap > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {cap}")
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or None, got "
                f"{type(self.optimizer).__name__}"
            )
        if self.process_group is not None and not is_group(self.process_group):
            raise TypeError(
                "process_group must be a torch.distributed.ProcessGroup, got "
                f"{type(self.process_group).__name__}"
            )
        for flag in _FLAGS:
            check_bool(flag, getattr(self, flag))
        if self.keep_anchor is not None:
            check_bool("keep_anchor", self.keep_anchor)
        if self.optimizer_state not in OPTIMIZER_STATE_POLICIES:
            raise ValueError(
                f"optimizer_state must be one of {OPTIMIZER_STATE_POLICIES}, "
                f"got {self.optimizer_state!r}"
            )
        if self.optimizer_state != "keep" and self.optimizer is None:
            raise ValueError(
                f"optimizer_state={self.optimizer_state!r} needs the optimizer: "
                "pass optimizer=... as well"
            )
        if self.zero_copy and self.offload_state:
            raise ValueError(
                "zero_copy=True and offload_state=True exclude each other: zero-copy rounds "
                "keep no state to offload; drop one of them"
            )
        if self.zero_copy and self.overlap:
            raise ValueError(
                "zero_copy=True runs a round's collective on the parameters themselves, so "
                "training cannot go on during it: drop overlap=True (or zero_copy=True)"
            )
        check_int("fragments", self.fragments, 1)
        if self.mixing is not None:
            if isinstance(self.mixing, bool) or not isinstance(self.mixing, (int, float)):
                raise TypeError(f"mixing must be a number in [0, 1] or None, got {type(self.mixing).__name__}")
            if not 0.0 <= self.mixing <= 1.0:
                raise ValueError(f"mixing must be in [0, 1], got {self.mixing}")
            if not self.overlap:
                raise ValueError("mixing= sets how an overlapped round is applied: pass overlap=True too")
        if self.zero_copy and isinstance(self.period, EverySeconds) and self.period.weighted:
            raise ValueError(
                "zero_copy=True keeps no anchor, which EverySeconds' weighting by steps needs: "
                "use EverySeconds(..., weighting='equal') or drop zero_copy=True"
            )
        if self.on_round is not None and not callable(self.on_round):
            raise TypeError(
                f"on_round must be callable(handle), got {type(self.on_round).__name__}"
            )
        self.schedule = as_schedule(self.period)
        if self.keep_anchor is False and isinstance(self.schedule, EverySeconds) \
                and self.schedule.weighted:
            raise ValueError(
                "keep_anchor=False, but EverySeconds' weighting by steps needs anchors: "
                "drop keep_anchor=False or use EverySeconds(..., weighting='equal')"
            )

    def wants_anchor(self, hook_needs_anchor: bool) -> bool:
        """Whether buckets keep anchors: ``keep_anchor`` if given, else when the hook
        declares ``needs_anchor`` or rounds overlap (the late correction needs one)."""
        if self.keep_anchor is not None:
            return self.keep_anchor
        weighted = isinstance(self.schedule, EverySeconds) and self.schedule.weighted
        return hook_needs_anchor or self.overlap or weighted

    @classmethod
    def from_call(cls, **arguments) -> AveragingOptions:
        """Build from keyword arguments; an unknown name is a ``TypeError`` listing the known."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(arguments) - set(known))
        if unknown:
            raise TypeError(
                f"register_averaging_hook: unknown option(s) {unknown}; accepted: {known}"
            )
        return cls(**arguments)
