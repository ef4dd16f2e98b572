"""``AveragingHandle``: the step counter, the public calls, stats and checkpoints.

The rounds themselves run in :mod:`ddp_avg_hooks.rounds`; what else a round does is a
policy (:mod:`~ddp_avg_hooks.policies`) or an observer (:mod:`~ddp_avg_hooks.observers`).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from . import memory
from .bucket import ParamBucket
from .observers import Reporter
from .planner import RoundPlanner
from ._saved_state import HandleCheckpointing, difference
from ._step_hooks import StepHooks
from .rounds import PendingRound, RoundEngine
from ._weights import RoundWeights

__all__ = ["AveragingHandle", "AveragingStats", "difference"]


@dataclasses.dataclass
class AveragingStats:
    """What averaging has cost so far on this rank.

    Attributes:
        rounds: averaging rounds completed.
        bytes_sent: bytes of the tensors this rank handed to collectives for averaging
            (as recorded by hooks with ``bucket.record_sent``, plus buffers and
            optimizer state when those are averaged).
        seconds: wall-clock seconds spent in rounds (copies, hooks, waits, write-back).
        wait_seconds: the part of ``seconds`` spent waiting for hooks' futures.
        last_round_bytes: ``bytes_sent`` of the latest round.
        consensus_distance: with ``track_consensus=True``, the mean over ranks of
            ``||params_r - average||^2`` (all parameters) at the latest round.
    """

    rounds: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    wait_seconds: float = 0.0
    last_round_bytes: int = 0
    consensus_distance: float | None = None

    @property
    def bytes_per_round(self) -> float:
        """Mean bytes this rank sent per round."""
        return self.bytes_sent / self.rounds if self.rounds else 0.0


class AveragingHandle(HandleCheckpointing):
    """What :func:`register_averaging_hook` returns: the schedule and the rounds.

    Call :meth:`step` after every optimizer step (or register with ``optimizer=``).
    Averaging happens at step ``s`` (the number of earlier ``step()`` calls) iff
    ``s >= warmup_steps and (s - warmup_steps) % period == 0``, exactly as PyTorch's
    ``PeriodicModelAverager``. (A schedule object as ``period`` decides the distance
    to the next round after each round instead; see ``ddp_avg_hooks.schedules``.)

    With a ``GradScaler``, do not pass ``optimizer=`` (a rank whose gradients overflowed
    skips its step alone): call ``handle.step()`` every iteration, after
    ``scaler.step(opt); scaler.update()`` (``verify=True`` catches drifting counters).

    With ``overlap=True`` a round is launched at its step and training goes on; the
    result is applied at the first later ``step()`` that finds it complete, at the
    latest before the next round (with ``fragments``: before the next round of the
    same fragment, so rounds of different fragments may be in flight together; with
    ``verify`` or ``track_consensus``, whose reports are collective, before the next
    round of any fragment), as ``params + (averaged - params_at_launch)`` (see
    :mod:`ddp_avg_hooks.rounds`), or with ``mixing=alpha`` as ``alpha * params + (1 -
    alpha) * averaged`` (Streaming DiLoCo's merge: ``alpha=0`` drops the steps taken
    while the round was in flight, ``alpha=1`` ignores the round). Time-based rounds
    keep one round in flight at a time, and the next one's clock starts when it
    completes (see ``schedules.EverySeconds``). ``average()``, ``state_dict()`` and
    ``remove()`` finish the rounds in flight first.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
        ...                                      period=3, warmup_steps=1)
        >>> [handle.step() for _ in range(6)], handle.in_warmup
        ([False, True, False, False, True, False], False)
        >>> handle.stats.rounds, handle.stats.bytes_sent
        (2, 80)
        >>> handle.load_state_dict(handle.state_dict()); handle.step_count
        6
        >>> handle.remove(); dist.destroy_process_group()
    """

    def __init__(self, ddp_model, engine: RoundEngine, options, *, policies=(), observers=()) -> None:
        self._engine = engine
        self.state = engine.state
        self._options = options
        self._schedule = options.schedule
        self._warmup_steps = options.warmup_steps
        self._plan = RoundPlanner(options.schedule, warmup_steps=options.warmup_steps,
                                  fragments=len(engine.fragments))
        self.process_group = engine.exact_group
        self.grad_process_group = getattr(ddp_model, "process_group", None) or dist.group.WORLD
        self._policies, self._reporter = list(policies), Reporter(list(observers))
        self._optimizer_hook = None
        self._in_flight: list[PendingRound] = []  # overlapped rounds, in launch order
        self._step_count = self._rounds_started = 0
        self._removed = False
        self.stats = AveragingStats()
        self._schedule.bind(self.process_group)
        self._weighted = getattr(self._schedule, "weighted", False) and \
            dist.get_world_size(self.process_group) > 1
        self._weights = RoundWeights(world=dist.get_world_size(self.process_group),
                                     fragments=len(engine.fragments), linear=engine.linear)

    # --- schedule ---------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls so far."""
        return self._step_count

    @property
    def period(self) -> int | None:
        """The period in force (constant unless a schedule object was given; ``None``
        for time-based rounds)."""
        return self._schedule.current

    @property
    def fragments(self) -> int:
        """How many fragments of the model take turns (``fragments=`` at registration)."""
        return len(self._engine.fragments)

    schedule = property(lambda self: self._schedule, doc="The period schedule object.")
    warmup_steps = property(lambda self: self._warmup_steps, doc="Steps before the first round.")

    @property
    def in_warmup(self) -> bool:
        """True while ``step_count < warmup_steps``: gradients are still averaged every step."""
        return self._step_count < self._warmup_steps

    @property
    def buckets(self) -> list[ParamBucket]:
        """The buckets built at registration (read-only use)."""
        return list(self._engine.buckets)

    @property
    def hook_name(self) -> str:
        return self._engine.name

    @property
    def rounds_started(self) -> int:
        """Rounds launched so far: the same on every rank after every step, overlap or not
        (``stats.rounds`` counts the finished ones)."""
        return self._rounds_started

    def is_averaging_step(self) -> bool:
        """Whether the next ``step()`` runs (or, with ``overlap``, launches) a round
        (for time-based rounds: if it were called now)."""
        return self._plan.due(self._step_count) is not None

    def step(self) -> bool:
        """Advance the schedule by one optimizer step; average if it says so.

        Collective on the averaging group when it averages. Returns True if a round
        ran (or was launched, with ``overlap=True``) at this step.
        """
        self._check_alive("step")
        if self._plan.timed:  # applying a round starts the clock of the next one
            overdue = self._plan.in_round_for() >= self._schedule.seconds
            for pending in list(self._in_flight):
                if pending.done() or overdue:
                    self._finish(pending)
        fragment = self._plan.due(self._step_count)
        averaging = fragment is not None
        for pending in list(self._in_flight):
            if pending.done() or (averaging and self._must_finish_before(pending, fragment)):
                self._finish(pending)
        if averaging:
            self._reporter.report_deferred(self)
            pending = self._launch(overlapped=self._options.overlap, fragment=fragment)
            if not pending.overlapped:
                self._finish(pending)
        elif self._step_count == self._warmup_steps - 1:
            # Warm-up kept the replicas identical; start the deltas from here.
            for bucket in self._engine.buckets:
                bucket._reset_anchor()
        self._step_count += 1
        return averaging

    def average(self) -> None:
        """Average now, outside the schedule (collective; the counter does not move)."""
        self._check_alive("average")
        self.synchronize()
        self._reporter.report_deferred(self)
        self._finish(self._launch(overlapped=False))

    def synchronize(self) -> None:
        """Finish the overlapped rounds in flight, if any (waits for them)."""
        for pending in list(self._in_flight):
            self._finish(pending)

    def _must_finish_before(self, pending: PendingRound, fragment: int) -> bool:
        """Whether an overlapped round in flight must be applied before ``fragment``'s
        round starts: one of the same fragment (with ``fragments=1``, every one), and
        every one when an observer's report is collective (all ranks must have finished
        the same rounds when it runs)."""
        return pending.fragment == fragment or any(o.collective for o in self._reporter.observers)

    # --- one round: the engine runs it, policies and observers hang off it -----------
    def _launch(self, *, overlapped: bool, fragment: int | None = None) -> PendingRound:
        """Launch a round of ``fragment`` (a scheduled one) or of everything (``None``)."""
        where = f"round {self._rounds_started + 1}, step {self._step_count}"
        # the policies' extras (buffers, optimizer state) go with the first fragment
        extras = [b for policy in self._policies for b in policy.buckets()] if not fragment else []
        scale, exchange = 1.0, None
        if fragment is not None:
            if self._weighted:
                scale, exchange = self._weights.start(
                    self._plan.local_steps(self._step_count, fragment), fragment,
                    self.process_group, where)
            self._plan.started(self._step_count, fragment)
        try:
            pending = self._engine.launch(overlapped=overlapped, extras=extras, where=where,
                                          fragment=fragment, delta_scale=scale)
        except BaseException:
            if fragment is not None:
                self._plan.finished()  # a failed round too: the schedule goes on
            raise
        pending.weights = exchange
        self._rounds_started += 1
        if overlapped:
            self._in_flight.append(pending)
            if self._plan.timed:  # the next round's clock starts as this one completes
                pending.record_completion(self._plan.clock)
        return pending

    def _finish(self, pending: PendingRound) -> None:
        self._in_flight = [p for p in self._in_flight if p is not pending]
        try:
            self._apply(pending)
        finally:  # a failed round too: the schedule goes on
            if pending.fragment is not None and not self._in_flight:
                self._plan.finished(pending.completed_at)

    def _apply(self, pending: PendingRound) -> None:
        try:
            factor = 1.0 if pending.weights is None else \
                self._weights.correction(pending.weights, pending.where)
            finished = self._engine.collect(pending)
        finally:
            self.stats.bytes_sent += pending.bytes_sent
            self.stats.last_round_bytes = pending.bytes_sent
        self.stats.wait_seconds += finished.wait_seconds
        if factor != 1.0:
            self._engine.rescale(pending, finished, factor)
        measured = self._reporter.measure(pending.buckets, finished)
        self._engine.write_back(pending, finished)
        for policy in self._policies:
            policy.after_write_back()
        self.stats.rounds += 1
        # Ranks apply an overlapped round at different steps, so its collective reports
        # wait for a step every rank shares: the next round (or average()).
        self._reporter.report_collective(self, self.stats.rounds, measured,
                                         overlapped=pending.overlapped)
        self.stats.seconds += time.perf_counter() - pending.started
        self._reporter.report_local(self, self.stats.rounds, measured)

    def memory_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this registration holds, ``{kind: {device: bytes}}`` (see :mod:`ddp_avg_hooks.memory`)."""
        policy_buckets = [b for policy in self._policies for b in policy.held_buckets()]
        return memory.count(self._engine.buckets, self.state, policy_buckets)

    # --- lifecycle --------------------------------------------------------------------
    def _check_alive(self, what: str) -> None:
        if self._removed:
            raise RuntimeError(
                f"AveragingHandle.{what}() after remove(): register the hook again to resume"
            )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Run :meth:`step` after every ``optimizer.step()`` (what ``optimizer=`` does)."""
        self._optimizer_hook = StepHooks(optimizer, self.step)

    def remove(self) -> None:
        """Stop averaging: finish a round in flight, detach from the optimizer, free the
        buckets. Idempotent."""
        if self._removed:
            return
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        try:
            self.synchronize()
        finally:
            self._removed = True
            self._engine.buckets, self._policies = [], []

    def __repr__(self) -> str:
        return (
            f"AveragingHandle(hook={self._engine.name}, period={self._schedule!r}, "
            f"warmup_steps={self._warmup_steps}, step_count={self._step_count}, "
            f"buckets={len(self._engine.buckets)})"
        )
