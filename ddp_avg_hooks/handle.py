"""``AveragingHandle``: the schedule, the rounds, their checks, stats and checkpoints."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .bucket import ParamBucket, assign_buckets
from .hooks._comm import is_member
from .hooks.default import allreduce_hook
from .schedules import PeriodSchedule

OPTIMIZER_STATE_POLICIES = ("keep", "average", "reset")


class AveragingHookError(RuntimeError):
    """An averaging hook failed or returned something other than the contract says."""


@dataclass
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


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Order-independent exact checksum of ``t``'s bits (the same on any thread count)."""
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(int_type).sum(dtype=torch.int64)


@dataclass
class _Round:
    """A launched round: the hooks' futures and those of the exact extras."""

    futures: list
    extra_futures: list
    started: float
    overlapped: bool


@dataclass
class HandleOptions:
    """Options of :func:`register_averaging_hook` beyond the contract's arguments."""

    check_finite: bool = False
    verify: bool = False
    overlap: bool = False
    track_consensus: bool = False
    average_buffers: bool = False
    optimizer_state: str = "keep"
    on_round: Callable | None = None


class AveragingHandle:
    """What :func:`register_averaging_hook` returns: the schedule and the rounds.

    Call :meth:`step` after every optimizer step (or register with ``optimizer=``).
    Averaging happens at step ``s`` (the number of earlier ``step()`` calls) iff
    ``s >= warmup_steps and (s - warmup_steps) % period == 0``, exactly as PyTorch's
    ``PeriodicModelAverager``. (A schedule object as ``period`` decides the distance
    to the next round after each round instead; see ``ddp_avg_hooks.schedules``.)

    With a ``GradScaler``, do not pass ``optimizer=``: the scaler skips
    ``optimizer.step()`` on a rank whose gradients overflowed, and after the warm-up
    gradients are local, so it may skip on one rank only. Call ``handle.step()`` every
    iteration instead, after ``scaler.step(opt); scaler.update()``, so every rank's
    counter advances together (``verify=True`` catches counters that drift apart).

    With ``overlap=True`` a round is launched at its step and training goes on; the
    result is applied at the first later ``step()`` that finds it complete, and at
    the latest before the next round, keeping the progress made meanwhile:
    ``params <- params + (averaged - params_at_launch)``. The replicas then agree on
    the anchor, not on the parameters: each keeps the local steps taken while the
    round was in flight (up to ``period - 1`` stale steps). The staleness costs loss:
    a correction computed at launch also undoes differences that local training has
    meanwhile resolved on its own. Keep a round's duration well under the period
    (a compressed hook, a longer period): on the benchmark model a round arriving
    a quarter of the period late cost 6% in loss, one arriving a whole period late
    15%, worse than not communicating (``benchmarks/RESULTS.md``, "Overlap
    staleness"). ``average()``,
    ``state_dict()`` and ``remove()`` finish a round in flight first. Hooks must read
    the parameters (``buffer()``, ``delta()``) before they return. The cross-rank
    checks of an overlapped round (``verify``, ``track_consensus``) run at the next
    round, the first step all ranks are sure to share.

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

    def __init__(
        self,
        ddp_model,
        hook: Callable,
        hook_name: str,
        state,
        buckets: list[ParamBucket],
        *,
        schedule: PeriodSchedule,
        warmup_steps: int,
        process_group,
        options: HandleOptions,
        buffers: list[torch.Tensor] = (),
        bucket_cap_mb: float = 25.0,
    ) -> None:
        self._ddp = ddp_model
        self._hook = hook
        self._hook_name = hook_name
        self.state = state
        self._buckets = buckets
        self._schedule = schedule
        self._warmup_steps = warmup_steps
        self._next_round = warmup_steps
        self.process_group = process_group
        self.grad_process_group = getattr(ddp_model, "process_group", None) or dist.group.WORLD
        self._options = options
        self._bucket_cap_mb = bucket_cap_mb
        self._buffer_buckets = assign_buckets(buffers, bucket_cap_mb) if buffers else []
        self._optimizer = None
        self._optimizer_hook = None
        self._state_buckets: list[ParamBucket] = []
        self._state_tensors: tuple = ()
        self._in_flight: _Round | None = None
        self._deferred_checks: tuple | None = None
        self._step_count = 0
        self._removed = False
        self.stats = AveragingStats()
        schedule.bind(process_group)

    # --- schedule ---------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls so far."""
        return self._step_count

    @property
    def period(self) -> int:
        """The period in force (constant unless a schedule object was given)."""
        return self._schedule.current

    @property
    def schedule(self) -> PeriodSchedule:
        return self._schedule

    @property
    def warmup_steps(self) -> int:
        return self._warmup_steps

    @property
    def in_warmup(self) -> bool:
        """True while ``step_count < warmup_steps``: gradients are still averaged every step."""
        return self._step_count < self._warmup_steps

    @property
    def buckets(self) -> list[ParamBucket]:
        """The buckets built at registration (read-only use)."""
        return list(self._buckets)

    def is_averaging_step(self) -> bool:
        """Whether the next ``step()`` runs (or, with ``overlap``, launches) a round."""
        return self._step_count == self._next_round

    def step(self) -> bool:
        """Advance the schedule by one optimizer step; average if it says so.

        Collective on the averaging group when it averages. Returns True if a round
        ran (or was launched, with ``overlap=True``) at this step.
        """
        self._check_alive("step")
        averaging = self.is_averaging_step()
        if self._in_flight is not None and (averaging or self._in_flight_done()):
            self._finish(self._in_flight)
        if averaging:
            self._run_deferred_checks()
            pending = self._launch(overlapped=self._options.overlap)
            if not pending.overlapped:
                self._finish(pending)
            self._next_round = self._step_count + self._schedule.next_period(self._step_count)
        elif self._step_count == self._warmup_steps - 1:
            # Warm-up kept the replicas identical; start the deltas from here.
            for bucket in self._buckets:
                bucket.reset_anchor()
        self._step_count += 1
        return averaging

    def average(self) -> None:
        """Average now, outside the schedule (collective; the counter does not move)."""
        self._check_alive("average")
        self.synchronize()
        self._run_deferred_checks()
        self._finish(self._launch(overlapped=False))

    def synchronize(self) -> None:
        """Finish an overlapped round in flight, if any (waits for it)."""
        if self._in_flight is not None:
            self._finish(self._in_flight)

    # --- the round --------------------------------------------------------------------
    def _error(self, bucket: ParamBucket, what: str) -> AveragingHookError:
        return AveragingHookError(
            f"averaging hook {self._hook_name!r} on bucket {bucket.index()} of "
            f"{len(self._buckets)} (round {self.stats.rounds + 1}, step {self._step_count}): {what}"
        )

    def _in_flight_done(self) -> bool:
        pending = self._in_flight
        return all(f.done() for f in pending.futures + pending.extra_futures)

    def _launch(self, *, overlapped: bool) -> _Round:
        started = time.perf_counter()
        futures = []
        with record_function("ddp_avg_hooks::round::launch"):
            for bucket in self._buckets:
                bucket.start_round()
                if overlapped:
                    bucket.snapshot_launch()
                try:
                    fut = self._hook(self.state, bucket)
                except Exception as exc:
                    raise self._error(bucket, f"raised {type(exc).__name__}: {exc}") from exc
                if not isinstance(fut, torch._C.Future):
                    raise self._error(
                        bucket,
                        f"returned {type(fut).__name__}; expected a torch.futures.Future "
                        "whose value is the bucket's new flat parameters",
                    )
                futures.append(fut)
            extras = self._extra_buckets()
            extra_futures = [self._exact_average(b) for b in extras]
        pending = _Round(futures, extra_futures, started, overlapped)
        if overlapped:
            self._in_flight = pending
        return pending

    def _exact_average(self, bucket: ParamBucket) -> torch.futures.Future:
        bucket.start_round()
        return allreduce_hook(self.process_group, bucket)

    def _finish(self, pending: _Round) -> None:
        self._in_flight = None
        try:
            wait_start = time.perf_counter()
            with record_function("ddp_avg_hooks::round::wait"):
                results = [self._result(b, f) for b, f in zip(self._buckets, pending.futures)]
                extra_results = [f.wait() for f in pending.extra_futures]
            self.stats.wait_seconds += time.perf_counter() - wait_start
        finally:
            sent = sum(b.take_bytes_sent() for b in self._buckets + self._extra_buckets())
            self.stats.bytes_sent += sent
            self.stats.last_round_bytes = sent
        local_distance = None
        if self._options.track_consensus:
            local_distance = self._local_squared_distance(results, pending.overlapped)
        # Every bucket's result is valid: only now does anything reach the parameters.
        with record_function("ddp_avg_hooks::round::write_back"):
            for bucket, value in zip(self._buckets, results):
                if pending.overlapped:
                    bucket.write_back_with_progress(value)
                else:
                    bucket.write_back(value)
            for bucket, value in zip(self._extra_buckets(), extra_results):
                bucket.write_back(value)
            if self._options.optimizer_state == "reset" and self._optimizer is not None:
                tensors = self._optimizer_state_tensors()
                if tensors:
                    torch._foreach_zero_(list(tensors))
        self.stats.rounds += 1
        if pending.overlapped:
            # Ranks apply an overlapped round at different steps, so the collective
            # checks wait for a step every rank shares: the next round (or average()).
            self._deferred_checks = (self.stats.rounds, local_distance)
        else:
            self._collective_checks(self.stats.rounds, local_distance)
        self.stats.seconds += time.perf_counter() - pending.started
        if self._options.on_round is not None:
            self._options.on_round(self)

    def _result(self, bucket: ParamBucket, fut: torch.futures.Future) -> torch.Tensor:
        try:
            value = fut.wait()
        except Exception as exc:
            raise self._error(bucket, f"its future raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(value, torch.Tensor):
            raise self._error(
                bucket,
                f"its future holds {type(value).__name__}; expected a floating-point tensor "
                f"of {bucket.numel()} elements",
            )
        if not value.is_floating_point():
            raise self._error(
                bucket, f"its future holds a {value.dtype} tensor; expected a floating-point one"
            )
        if value.numel() != bucket.numel():
            raise self._error(
                bucket,
                f"its future holds {value.numel()} elements; expected {bucket.numel()} "
                "(one per parameter element of the bucket)",
            )
        if self._options.check_finite and not bool(torch.isfinite(value).all()):
            raise self._error(bucket, "result has nan or inf (check_finite=True); nothing written")
        return value

    # --- buffers and optimizer state: averaged exactly, beside the hook ----------------
    def _extra_buckets(self) -> list[ParamBucket]:
        return self._buffer_buckets + self._optimizer_state_buckets()

    def _optimizer_state_tensors(self) -> tuple:
        """Floating-point state tensors shaped like their parameter (momentum, moments)."""
        tensors = []
        for bucket in self._buckets:
            for p in bucket.parameters():
                for key, value in sorted(self._optimizer.state.get(p, {}).items()):
                    if (isinstance(value, torch.Tensor) and value.is_floating_point()
                            and value.shape == p.shape and key != "step"):
                        tensors.append(value)
        return tuple(tensors)

    def _optimizer_state_buckets(self) -> list[ParamBucket]:
        if self._options.optimizer_state != "average" or self._optimizer is None:
            return []
        tensors = self._optimizer_state_tensors()
        if tuple(map(id, tensors)) != self._state_tensors:  # first round or state replaced
            self._state_tensors = tuple(map(id, tensors))
            self._state_buckets = assign_buckets(tensors, self._bucket_cap_mb) if tensors else []
        return self._state_buckets

    # --- telemetry and guards -----------------------------------------------------------
    def _local_squared_distance(self, results, from_launch: bool) -> torch.Tensor:
        return sum((b.squared_distance(v, from_launch=from_launch).cpu()
                    for b, v in zip(self._buckets, results)), torch.zeros((), dtype=torch.float64))

    def _run_deferred_checks(self) -> None:
        if self._deferred_checks is not None:
            round_number, local_distance = self._deferred_checks
            self._deferred_checks = None
            self._collective_checks(round_number, local_distance)

    def _collective_checks(self, round_number: int, local_distance) -> None:
        """The checks that talk to the other ranks: consensus distance, verify."""
        if not is_member(self.process_group):
            return
        if local_distance is not None:
            total = local_distance.reshape(1).to(self._buckets[0].device)
            dist.all_reduce(total, group=self.process_group)
            self.stats.consensus_distance = float(total) / dist.get_world_size(self.process_group)
        if self._options.verify:
            self._verify_agreement(round_number)

    def _verify_agreement(self, round_number: int) -> None:
        """Compare the step counter and an exact checksum of every bucket across ranks."""
        sums = [_checksum(bucket.anchor() if self._options.overlap and bucket.has_anchor()
                          else bucket.load_parameters()).cpu() for bucket in self._buckets]
        local = torch.stack([torch.tensor(self._step_count, dtype=torch.int64), *sums])
        if dist.get_backend(self.process_group) == "nccl":
            local = local.to(self._buckets[0].device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(gathered, local, group=self.process_group)
        for rank, other in enumerate(gathered):
            if other[0] != gathered[0][0]:
                raise AveragingHookError(
                    f"verify=True: step counters differ after round {round_number} of "
                    f"{self._hook_name!r}: group rank 0 is at step {int(gathered[0][0])}, "
                    f"group rank {rank} at {int(other[0])} (was a step skipped on one rank?)"
                )
            diff = (other[1:] != gathered[0][1:]).nonzero()
            if len(diff):
                raise AveragingHookError(
                    f"verify=True: after round {round_number} of {self._hook_name!r}, "
                    f"bucket {int(diff[0])} differs between group ranks 0 and {rank}"
                )

    # --- lifecycle --------------------------------------------------------------------
    def _check_alive(self, what: str) -> None:
        if self._removed:
            raise RuntimeError(
                f"AveragingHandle.{what}() after remove(): register the hook again to resume"
            )

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, *, step_hook: bool = True) -> None:
        """Use ``optimizer``'s state for ``optimizer_state=``; with ``step_hook``, run
        :meth:`step` after every ``optimizer.step()``."""
        self._optimizer = optimizer
        if step_hook:
            self._optimizer_hook = optimizer.register_step_post_hook(lambda *_: self.step())

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
            self._buckets, self._buffer_buckets, self._state_buckets = [], [], []

    # --- checkpointing ----------------------------------------------------------------
    def config(self) -> dict:
        """What every rank, and a checkpoint being loaded, must agree on."""
        return {
            "hook": self._hook_name,
            "period": self._schedule.describe(),
            "warmup_steps": self._warmup_steps,
            "overlap": self._options.overlap,
            "layout": [b.layout() for b in self._buckets],
        }

    def state_dict(self) -> dict:
        """This rank's averaging state: counter, anchors, hook state, config.

        Tensors and plain values only, so ``torch.save`` takes it; it differs between
        ranks (error feedback, local progress), so save one per rank.
        """
        self._check_alive("state_dict")
        self.synchronize()
        out = {
            "step_count": self._step_count,
            "next_round": self._next_round,
            "config": self.config(),
            "schedule": self._schedule.state_dict(),
            "anchors": [b.anchor().clone() if b.has_anchor() else None for b in self._buckets],
            "bucket_memory": [
                {k: v.clone() for k, v in b.memory().items()} for b in self._buckets
            ],
        }
        if hasattr(self.state, "state_dict"):
            out["hook_state"] = self.state.state_dict()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved (on this rank, into a fresh handle).

        Raises ``ValueError`` naming the first difference when the checkpoint was made
        with another hook, period, warm-up or bucket layout; nothing is changed then.
        """
        self._check_alive("load_state_dict")
        if not isinstance(state_dict, dict) or "step_count" not in state_dict:
            raise TypeError(
                "load_state_dict: expected the dict returned by AveragingHandle.state_dict(), "
                f"got {type(state_dict).__name__}"
                + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else "")
            )
        self.synchronize()
        saved = state_dict.get("config", {})
        for key, mine in self.config().items():
            if key in saved and saved[key] != mine:
                raise ValueError(f"load_state_dict: {difference(key, saved[key], mine)}; "
                                 "register with the same settings to resume")
        anchors = state_dict.get("anchors") or [None] * len(self._buckets)
        for bucket, anchor in zip(self._buckets, anchors):
            if bucket.has_anchor() and anchor is None:
                raise ValueError(
                    f"load_state_dict: bucket {bucket.index()} keeps an anchor but the "
                    "checkpoint has none (was it saved by a handle without keep_anchor?)"
                )
        has_hook_state = hasattr(self.state, "load_state_dict")
        if has_hook_state != ("hook_state" in state_dict):
            raise ValueError(
                "load_state_dict: the checkpoint "
                + ("has no hook state but this hook's state needs one"
                   if has_hook_state else "has a hook state but this hook's state takes none")
            )
        if has_hook_state:
            self.state.load_state_dict(state_dict["hook_state"])
        self._schedule.load_state_dict(state_dict.get("schedule", {}))
        memories = state_dict.get("bucket_memory") or [{} for _ in self._buckets]
        for bucket, anchor, memory in zip(self._buckets, anchors, memories):
            if bucket.has_anchor():
                bucket.anchor().copy_(anchor)
            bucket.memory().clear()
            bucket.memory().update({k: v.to(bucket.device).clone() for k, v in memory.items()})
        self._step_count = int(state_dict["step_count"])
        self._next_round = int(state_dict.get("next_round", self._next_round_for_constant()))

    def _next_round_for_constant(self) -> int:
        s, w, p = self._step_count, self._warmup_steps, self._schedule.current
        return w if s <= w else s + (-(s - w)) % p

    def __repr__(self) -> str:
        return (
            f"AveragingHandle(hook={self._hook_name}, period={self._schedule!r}, "
            f"warmup_steps={self._warmup_steps}, step_count={self._step_count}, "
            f"buckets={len(self._buckets)})"
        )


def difference(key: str, theirs, mine) -> str:
    """One sentence naming where a saved or remote config differs from this one."""
    if key == "layout":
        if len(theirs) != len(mine):
            return f"the bucket layout differs: {len(theirs)} buckets there, {len(mine)} here"
        i = next(i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b)
        return f"the bucket layout differs at bucket {i}: {theirs[i]} there, {mine[i]} here"
    return f"{key!r} differs: {theirs!r} there, {mine!r} here"


def warn_redundant_buffer_averaging(ddp_model) -> None:
    if getattr(ddp_model, "broadcast_buffers", False):
        warnings.warn(
            "average_buffers=True with DistributedDataParallel(broadcast_buffers=True): "
            "DDP already overwrites every rank's buffers with rank 0's at each forward, so "
            "averaging them is wasted; construct DDP with broadcast_buffers=False",
            stacklevel=3,
        )
