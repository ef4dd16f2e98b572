"""``AveragingOptions``: every setting of a registration, documented and checked in one place.

:func:`~ddp_avg_hooks.register_averaging_hook` builds one from its arguments; nothing
else checks them. Each field carries its documentation (``AveragingOptions.doc(name)``,
and the documentation's table of options is :func:`markdown_table`), and
:attr:`AveragingOptions.AGREED` lists the fields every rank of the averaging group
must set alike, because they change the collectives or the result.

Example:
    >>> from ddp_avg_hooks.options import AveragingOptions
    >>> AveragingOptions(period=4, overlap=True).wants_anchor(hook_needs_anchor=False)
    True
    >>> AveragingOptions(optimizer_state="average")
    Traceback (most recent call last):
    ...
    ValueError: optimizer_state='average' needs the optimizer: pass optimizer=... as well
    >>> print(AveragingOptions.doc("fragments").split(":")[0])
    int K >= 1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ._checks import check_bool, check_int
from ._groups import is_group
from .planner import check_fragment_layout
from .schedules import ConstantPeriod, EverySeconds, PeriodSchedule, as_schedule

__all__ = ["AveragingOptions", "OPTIMIZER_STATE_POLICIES", "markdown_table"]

OPTIMIZER_STATE_POLICIES = ("keep", "average", "reset")


def _option(default, doc: str, *, agreed: bool = False):
    return dataclasses.field(default=default, metadata={"doc": doc, "agreed": agreed})


@dataclasses.dataclass
class AveragingOptions:
    """The arguments of :func:`~ddp_avg_hooks.register_averaging_hook`, validated.

    Every field is documented by ``AveragingOptions.doc(name)``; ``schedule`` is
    ``period`` as a schedule object.
    """

    period: int | PeriodSchedule = _option(1, (
        "int >= 1 or a schedule: average every `period` steps after the warm-up, or as a "
        "schedule from `ddp_avg_hooks.schedules` decides (`EverySeconds` for time-based "
        "rounds)"), agreed=True)
    warmup_steps: int = _option(0, (
        "int >= 0: steps before the first round, during which DDP still averages gradients "
        "(with `grad_hooks.local_sgd_grad_hook`; FSDP2: `register_fsdp_grad_hooks`). Hooks "
        "that send changes start them at its end; replicas that differ there (gradients "
        "kept local) start from their exact average instead, with a warning"),
        agreed=True)
    bucket_cap_mb: float = _option(25.0, (
        "number > 0: the largest bucket, in MiB; a bigger parameter gets a bucket of its own"),
        agreed=True)
    optimizer: torch.optim.Optimizer | None = _option(None, (
        "a `torch.optim.Optimizer`: `handle.step()` runs after each of its steps "
        "(needed by `optimizer_state`); calling `handle.step()` as well is a "
        "`RuntimeError` (`handle.detach_optimizer()` hands the stepping back)"))
    keep_anchor: bool | None = _option(None, (
        "bool: keep the parameters as of the last round in every bucket (default: when the "
        "hook declares `needs_anchor`, rounds overlap, or time-based rounds weigh by steps)"),
        agreed=True)
    process_group: object = _option(None, (
        "a process group: the group whose ranks must agree on the settings and over which "
        "buffers and optimizer state are averaged (default: the hook state's group, else "
        "the default group)"), agreed=True)
    check_finite: bool = _option(False, (
        "bool: reject a round whose result holds nan or inf, before anything is written"),
        agreed=True)
    verify: bool = _option(False, (
        "bool: after each round, compare the step counter and an exact checksum of every "
        "bucket across ranks (one small all-gather)"), agreed=True)
    overlap: bool = _option(False, (
        "bool: launch a round and keep training; apply it later as `params + (averaged - "
        "params_at_launch)`, at the first step that finds it complete, so the step it lands "
        "at, and the run's results, depend on timing (a `RoundCheckpointer` save finishes "
        "it at its launch; `overlap_steps` fixes the step instead). Keep a round's duration "
        "well under the period: the correction is stale by the steps taken meanwhile, and a "
        "round a whole period late can cost more loss than it saves. Buffers and optimizer "
        "state averaged by the round take the same rule (a copy of them is kept for it); "
        "one that held no negative value at launch (Adam's second moment, a running "
        "variance) is kept no lower than the smaller of its value and its average"),
        agreed=True)
    overlap_steps: int | None = _option(None, (
        "int >= 1, with `overlap`: apply each round exactly this many steps after its "
        "launch, waiting for it there if it is not complete (earlier only where a round "
        "must finish first: the next round of its fragment, `average()`, `state_dict()`), "
        "so the step it lands at, and the run's results, no longer depend on timing, and a "
        "run resumed from any save repeats the one that saved. `1` keeps rounds as fresh as "
        "they can be; a round that takes longer than that many steps makes training wait "
        "for it (the comm wait). At most the period (a round must land before its "
        "fragment's next round starts; with a changing period, a round still in flight then "
        "lands there). Not with time-based rounds (`EverySeconds`)"), agreed=True)
    track_consensus: bool = _option(False, (
        "bool: measure the replicas' mean squared distance from their average at each "
        "round, `stats.consensus_distance` (one scalar all-reduce; with FSDP2 a second one "
        "inside the replica group, adding up its shards)"), agreed=True)
    average_buffers: bool = _option(False, (
        "bool: average floating-point buffers (BatchNorm statistics) exactly at each round"),
        agreed=True)
    optimizer_state: str = _option("keep", (
        "`\"keep\"`, `\"average\"` or `\"reset\"`: what a round does to the optimizer's "
        "state: average its momentum and Adam moments exactly, or empty it so that the next "
        "step starts it afresh, as a new optimizer's first step does (Adam's step count and "
        "bias correction included); needs `optimizer=`. "
        "With `\"average\"`, each round first checks that every rank holds the same state "
        "tensors (one small all-gather): state tensors that differ in name, shape or dtype "
        "(another optimizer class, or a setting that changes them, such as Adam's "
        "`amsgrad`) are a `SettingsMismatchError` on every rank; hyperparameters that "
        "leave the tensors alike (Adam's `betas`) are not compared"),
        agreed=True)
    on_round: Callable | None = _option(None, (
        "`callable(handle)`: runs on every rank after each round"))
    zero_copy: bool = _option(False, (
        "bool: parameters become views of their bucket's flat storage, once, at registration "
        "(`data_ptr()` changes then and the memory format becomes contiguous); exact rounds "
        "then copy nothing and hold no buffer; a collective that fails midway leaves its "
        "bucket partly reduced; not with `overlap` (see `ddp_avg_hooks.storage`)"))
    offload_state: bool = _option(False, (
        "bool: anchors, the half hooks' residuals and the outer optimizer's parameters and "
        "state live in host memory, pinned for CUDA parameters, and are copied in and out a "
        "bucket at a time; results are bit-identical; between rounds the device holds "
        "nothing but the parameters (see `ddp_avg_hooks.storage`)"))
    fragments: int = _option(1, (
        "int K >= 1: streaming rounds: the parameters, dealt into K near-equal fragments "
        "as `fragment_layout` says, take turns; fragment `f` is averaged at step `s` iff `s >= "
        "warmup_steps and (s - warmup_steps - f * period // K) % period == 0`, so every "
        "parameter is averaged once per period and a round sends 1/K of the model; "
        "`period < K` is a `ValueError`; buffers and optimizer state go with fragment 0; "
        "with `outer_optimizer` each fragment takes its own outer step (Streaming DiLoCo); "
        "with `overlap`, rounds of different fragments are in flight together, each applied "
        "at the latest before its own fragment's next round"), agreed=True)
    fragment_layout: str = _option("contiguous", (
        "`\"contiguous\"` or `\"interleaved\"`, with `fragments > 1`: how the parameters are "
        "dealt into fragments, never splitting one. `contiguous` cuts them in parameter "
        "order, so a fragment holds neighbouring layers; `interleaved` deals the largest "
        "first, each to the fragment with the fewest elements so far, so every fragment "
        "takes layers from all over the model (see `ddp_avg_hooks.planner.split_fragments`)"),
        agreed=True)
    mixing: float | None = _option(None, (
        "number in [0, 1], with `overlap`: apply a late round as `alpha * params + (1 - "
        "alpha) * averaged` (Streaming DiLoCo's merge) instead of adding the change; this "
        "halves the replicas' distance at each round instead of carrying it; `0.5` is the "
        "setting to start from when rounds take a large part of the period"), agreed=True)

    #: the fields every rank of the averaging group must set alike, since they change
    #: the collectives a round issues or the result it writes
    AGREED = ()  # filled in below, from the fields' declarations

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
        for f in dataclasses.fields(self):
            if f.type == "bool":
                check_bool(f.name, getattr(self, f.name))
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
        check_fragment_layout(self.fragment_layout, "fragment_layout")
        if self.fragment_layout != "contiguous" and self.fragments == 1:
            raise ValueError(f"fragment_layout={self.fragment_layout!r} sets how fragments=K "
                             "cut the model: pass fragments=K (K > 1) too")
        if self.mixing is not None:
            if isinstance(self.mixing, bool) or not isinstance(self.mixing, (int, float)):
                raise TypeError("mixing must be a number in [0, 1] or None, got "
                                f"{type(self.mixing).__name__}")
            if not 0.0 <= self.mixing <= 1.0:
                raise ValueError(f"mixing must be in [0, 1], got {self.mixing}")
            if not self.overlap:
                raise ValueError("mixing= sets how an overlapped round is applied: "
                                 "pass overlap=True too")
        if self.overlap_steps is not None:
            check_int("overlap_steps", self.overlap_steps, 1)
            if not self.overlap:
                raise ValueError("overlap_steps= sets when an overlapped round is applied: "
                                 "pass overlap=True too")
        if self.on_round is not None and not callable(self.on_round):
            raise TypeError(
                f"on_round must be callable(handle), got {type(self.on_round).__name__}"
            )
        self.schedule = as_schedule(self.period)
        timed, weighted = isinstance(self.schedule, EverySeconds), self.weighted
        if self.zero_copy and weighted:
            raise ValueError(
                "zero_copy=True keeps no anchor, which EverySeconds' weighting by steps needs: "
                "use EverySeconds(..., weighting='equal') or drop zero_copy=True"
            )
        if self.keep_anchor is False and weighted:
            raise ValueError(
                "keep_anchor=False, but EverySeconds' weighting by steps needs anchors: "
                "drop keep_anchor=False or use EverySeconds(..., weighting='equal')"
            )
        if self.overlap_steps is not None and timed:
            raise ValueError(
                "overlap_steps= applies a round a fixed number of steps after its launch, "
                "but EverySeconds starts the next round's clock when a round completes: drop "
                "overlap_steps (or use an int period)")
        if self.overlap_steps is not None and isinstance(self.schedule, ConstantPeriod) \
                and self.overlap_steps > self.schedule.current:
            raise ValueError(
                f"overlap_steps={self.overlap_steps} is more than the period "
                f"({self.schedule.current}): a round must be applied before its fragment's "
                f"next round starts, one period after its launch; pass overlap_steps <= "
                f"{self.schedule.current}")
        if self.fragments > 1 and not (timed or isinstance(self.schedule, ConstantPeriod)):
            raise ValueError(
                f"fragments={self.fragments} needs an int period or schedules.EverySeconds, "
                f"got {self.schedule!r}: fragments take turns at fixed offsets within one period"
            )
        if self.fragments > 1 and not timed and self.schedule.current < self.fragments:
            raise ValueError(
                f"period ({self.schedule.current}) must be >= fragments ({self.fragments}): "
                "each fragment needs a step of its own within a period"
            )

    @property
    def weighted(self) -> bool:
        """Whether rounds weigh ranks by their local steps (``EverySeconds(weighting="steps")``)."""
        return isinstance(self.schedule, EverySeconds) and self.schedule.weighted

    def wants_anchor(self, hook_needs_anchor: bool) -> bool:
        """Whether buckets keep anchors: ``keep_anchor`` if given, else when the hook
        declares ``needs_anchor``, rounds overlap (the late correction needs one) or
        time-based rounds weigh ranks by their steps."""
        if self.keep_anchor is not None:
            return self.keep_anchor
        return hook_needs_anchor or self.overlap or self.weighted

    @classmethod
    def doc(cls, name: str) -> str:
        """The documentation of option ``name``."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if name not in fields:
            raise KeyError(f"AveragingOptions has no option {name!r}; options: {sorted(fields)}")
        return fields[name].metadata["doc"]

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


AveragingOptions.AGREED = tuple(f.name for f in dataclasses.fields(AveragingOptions)
                                if f.metadata["agreed"])


def markdown_table() -> str:
    """The options as a Markdown table (option, default, meaning), as the docs show them.

    Example:
        >>> markdown_table().splitlines()[0]
        '| option | default | meaning |'
    """
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for f in dataclasses.fields(AveragingOptions):
        rows.append(f"| `{f.name}` | `{f.default!r}` | {f.metadata['doc']} |")
    return "\n".join(rows)
