"""``AveragingHandle``: the step counter, the schedule, the public calls and checkpoints.

A round itself is the round engine's (:mod:`ddp_avg_hooks.rounds`); the handle decides
when one runs (:mod:`ddp_avg_hooks.planner`), keeps the overlapped rounds in flight, and
saves and restores its state.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from . import memory
from ._groups import is_member
from .bucket import ParamBucket
from .collectives import backend_device, callbacks_pending, gather_small
from .errors import SettingsMismatchError
from .grad_hooks import ReducerSwitch
from .models import AveragedModel
from .observers import bucket_checksum
from .options import AveragingOptions
from .planner import RoundPlanner
from .protocol import hook_spec
from .rounds import AveragingStats, Round, RoundEngine
from .step_hooks import StepHooks

__all__ = ["AveragingHandle", "AveragingStats", "difference"]

# the keys of state_dict() that load_state_dict() needs
_KEYS = ("step_count", "next_round", "plan", "weight_totals", "config", "schedule", "anchors",
         "bucket_memory", "stats")
# settings a checkpoint's config may lack, having been written before they existed, with
# the value it was made with
_ADDED_SETTINGS = {"fragment_layout": "contiguous", "overlap_steps": None}
# the newest handle registered on each DDP model: DDP keeps one comm hook for a model's
# lifetime, so a hook given a handle that was removed follows the one registered after it
_NEWEST_ON_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def setting_name(key: str, theirs, mine) -> str:
    """The setting two configs' entries ``key`` differ in: ``key`` itself, or for
    ``"hook_settings"`` the first hook setting that differs, in the order the hook state
    lists them (a class before its hyperparameters: another outer optimizer is named as
    such, not by a setting only one of the two classes has)."""
    if key == "hook_settings" and isinstance(theirs, dict) and isinstance(mine, dict):
        names = [*mine, *(n for n in theirs if n not in mine)]
        return next((n for n in names if theirs.get(n, _MISSING) != mine.get(n, _MISSING)), key)
    return key


_MISSING = "(not set)"


def difference(key: str, theirs, mine, *, theirs_at: str = "there", mine_at: str = "here") -> str:
    """One sentence naming where two configs (see :meth:`AveragingHandle.config`) differ."""
    name = setting_name(key, theirs, mine)
    if name != key:
        return (f"the hook's setting {name!r} differs: {theirs.get(name, _MISSING)!r} "
                f"{theirs_at}, {mine.get(name, _MISSING)!r} {mine_at}")
    if key == "shards":
        if len(theirs) != len(mine):
            return (f"the ranks hold different parameters' shards: {len(theirs)} non-empty "
                    f"local shards {theirs_at}, {len(mine)} {mine_at}")
        a, b = next((a, b) for a, b in zip(theirs, mine) if a != b)
        return (f"parameter {b[0]!r} is sharded differently: {a[1:]} {theirs_at}, {b[1:]} "
                f"{mine_at} (global shape, placements, shard mesh size, shard index): ranks "
                "that average together must hold the same shards; pass the replicate group "
                "(mesh['replicate'].get_group()) as the hook's state")
    if key == "layout":
        if len(theirs) != len(mine):
            return (f"the bucket layout differs: {len(theirs)} buckets {theirs_at}, "
                    f"{len(mine)} {mine_at}")
        i = next(i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b)
        return (f"the bucket layout differs at bucket {i}: {theirs[i]} {theirs_at}, "
                f"{mine[i]} {mine_at}")
    return f"{key!r} differs: {theirs!r} {theirs_at}, {mine!r} {mine_at}"


def align_anchors(buckets: list[ParamBucket], group) -> bool:
    """Make the anchors of ``buckets`` the same on every rank of ``group``: where the
    ranks' parameters differ, each anchor becomes their exact average, so that a hook
    that sends the change since the anchor brings the replicas together at its first
    round instead of keeping each one's offset. Returns whether they differed. Collective
    on ``group`` when a bucket keeps an anchor (one all-gather of a checksum per bucket;
    an all-reduce of the parameters only where they differ)."""
    anchored = [b for b in buckets if b.has_anchor()]
    if not anchored or not is_member(group) or dist.get_world_size(group) == 1:
        return False
    gathered = gather_small(torch.stack([bucket_checksum(b).cpu() for b in anchored]), group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return False
    for bucket in anchored:
        mean = torch.cat([p.detach().reshape(-1) for p in bucket.parameters()])
        dist.all_reduce(mean, group=group)
        bucket.stored_anchor().copy_(mean.div_(dist.get_world_size(group)))
    return True


class AveragingHandle(Joinable):
    """What :func:`~ddp_avg_hooks.register_averaging_hook` returns: the schedule and the rounds.

    Call :meth:`step` after every optimizer step (or register with ``optimizer=``).
    Averaging happens at step ``s`` (the number of earlier ``step()`` calls) iff
    ``s >= warmup_steps and (s - warmup_steps) % period == 0``, exactly as PyTorch's
    ``PeriodicModelAverager``. (A schedule object as ``period`` decides the distance
    to the next round after each round instead; see ``ddp_avg_hooks.schedules``.)

    With a ``GradScaler``, do not pass ``optimizer=`` (a rank whose gradients overflowed
    skips its step alone): call ``handle.step()`` every iteration, after
    ``scaler.step(opt); scaler.update()`` (``verify=True`` catches drifting counters).

    With ``overlap=True`` a round is launched at its step and training goes on; the
    result is applied at the first later ``step()`` that finds it complete (with
    ``overlap_steps=N``: at the ``step()`` N steps after its launch, waiting for it
    there if need be, so that results do not depend on timing), at the latest before
    the next round (with ``fragments``: before the next round of the
    same fragment, so rounds of different fragments may be in flight together; with
    ``verify`` or ``track_consensus``, whose reports are collective, before the next
    round of any fragment), as ``params + (averaged - params_at_launch)`` (see
    :mod:`ddp_avg_hooks.rounds`), or with ``mixing=alpha`` as ``alpha * params + (1 -
    alpha) * averaged`` (Streaming DiLoCo's merge: ``alpha=0`` drops the steps taken
    while the round was in flight, ``alpha=1`` ignores the round). Time-based rounds
    keep one round in flight at a time, and the next one's clock starts when it
    completes (see ``schedules.EverySeconds``). ``average()``, ``state_dict()`` and
    ``remove()`` finish the rounds in flight first; a program that ends without
    ``remove()`` waits at exit (up to ``rounds.EXIT_WAIT_SECONDS``) for them to
    complete, applying nothing (:func:`~ddp_avg_hooks.rounds.settle_in_flight`).

    Uneven inputs: train inside ``torch.distributed.algorithms.join.Join([ddp, handle])``
    (the DDP model first), as with DDP alone. A rank whose inputs run out keeps taking
    part in the rounds of the ranks still training without a step of its own: it sends
    a change of zero (as DDP's joined ranks send zero gradients) and takes each round's
    result like the others; at the end DDP
    gives every rank the model of the last rank to join. Inside ``Join`` each
    ``step()`` must follow exactly one forward of the DDP model (``Join`` counts forwards
    as steps): accumulate gradients or evaluate outside it, or through ``ddp.module``.
    Not for FSDP2 models, nor with time-based rounds (end those on a round count).

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

    def __init__(self, engine: RoundEngine, options: AveragingOptions, *,
                 model: AveragedModel | None = None) -> None:
        super().__init__()  # Joinable: not inside a Join until one is made
        self._engine = engine
        self.state = engine.state
        self._options = options
        self._schedule = options.schedule
        self._plan = RoundPlanner(options.schedule, warmup_steps=options.warmup_steps,
                                  fragments=len(engine.fragments))
        #: the group the rounds average over
        self.process_group = engine.exact_group
        self._model = model
        #: the group DDP averages gradients over (for ``local_sgd_grad_hook``)
        self.grad_process_group = (model and model.grad_process_group) or dist.group.WORLD
        #: turns DDP's gradient reducer off after the warm-up (``None`` for FSDP2)
        ddp = self._ddp()
        self.reducer_switch = ReducerSwitch(ddp) if ddp is not None else None
        if ddp is not None:
            _NEWEST_ON_MODEL[ddp] = weakref.ref(self)
        self._optimizer_hook = None
        self._in_flight: list[Round] = []  # overlapped rounds, in launch order
        self._step_count = self._rounds_started = 0
        self._removed = False
        self._forwards = 0  # DDP forwards since the last step, counted inside a Join block
        self._forward_counter = None
        self._joined_step_hooks: list = []  # run after each stand-in step inside a Join
        self._schedule.bind(self.process_group)
        # time-based rounds of a sharded model: the ranks of a replica group step together,
        # so they decide together whether a round is due (one flag, inside the group)
        self._due_group = None
        if self.sharded and self._plan.timed and dist.get_world_size(self.replica_group) > 1:
            self._due_group = self.replica_group

    # --- schedule ---------------------------------------------------------------------
    @property
    def options(self) -> AveragingOptions:
        """The registration's settings (read-only use)."""
        return self._options

    @property
    def sharded(self) -> bool:
        """Whether the model is an FSDP2 one (each rank averages its local shards)."""
        return self._model is not None and self._model.sharded

    @property
    def replica_group(self):
        """With FSDP2, the process group of this rank's replica group (the shard mesh's:
        the ranks that hold the other shards of the same replica); ``None`` for DDP."""
        return self._model.replica_group if self.sharded else None

    @property
    def stats(self) -> AveragingStats:
        """What averaging has cost so far on this rank (see :class:`AveragingStats`)."""
        return self._engine.stats

    @property
    def step_count(self) -> int:
        """Number of ``step()`` calls so far (one whose round raised included: the
        schedule goes on, and the next round is at its usual step)."""
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

    @property
    def schedule(self):
        """The period schedule object."""
        return self._schedule

    @property
    def warmup_steps(self) -> int:
        """Steps before the first round."""
        return self._options.warmup_steps

    @property
    def in_warmup(self) -> bool:
        """True while ``step_count < warmup_steps``: gradients are still averaged every step."""
        return self._step_count < self._options.warmup_steps

    @property
    def buckets(self) -> list[ParamBucket]:
        """The buckets built at registration (read-only use)."""
        return list(self._engine.buckets)

    @property
    def hook_name(self) -> str:
        """``module.qualname`` of the registered hook."""
        return self._engine.name

    @property
    def removed(self) -> bool:
        """Whether :meth:`remove` has run: the handle averages nothing more."""
        return self._removed

    @property
    def successor(self) -> AveragingHandle | None:
        """Once this handle is removed, the live handle registered on the same DDP model
        after it (the newest), else ``None``. DDP takes one comm hook per model for good,
        so :func:`~ddp_avg_hooks.grad_hooks.local_sgd_grad_hook` given this handle
        follows its successor's warm-up, and averages gradients every step, as plain DDP
        does, while there is none."""
        ddp = self._ddp() if self._removed else None
        ref = _NEWEST_ON_MODEL.get(ddp) if ddp is not None else None
        newest = ref() if ref is not None else None
        return newest if newest is not None and not newest.removed else None

    @property
    def rounds_started(self) -> int:
        """Rounds launched so far, the same on every rank after every step, overlap or not
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
        if self._optimizer_hook is not None:
            raise RuntimeError(
                "AveragingHandle.step() called while the handle already steps after each "
                "optimizer.step() (optimizer= was passed): each optimizer step would count "
                "twice and the period halve. Drop the explicit step() call, or call "
                "handle.detach_optimizer() to step the handle yourself")
        return self._advance()

    def _advance(self, *, joined: bool = False) -> bool:
        """:meth:`step`'s work; the optimizer's post-hook calls it directly, and inside a
        ``Join`` a rank whose inputs ran out (``joined``) once per step of the others."""
        self._check_alive("step")
        if not joined and self._join_config.enable:
            self._notify_join()
        try:
            return self._step_rounds()
        finally:  # a step whose round failed is counted too: the schedule goes on
            self._step_count += 1

    def _step_rounds(self) -> bool:
        """The rounds of the step ``step_count`` (before it is counted): apply those that
        land, launch the one due; whether one was launched."""
        if self._plan.timed:  # applying a round starts the clock of the next one
            overdue = self._plan.in_round_for() >= self._schedule.seconds
            for rnd in list(self._in_flight):
                if rnd.done() or overdue:
                    self._finish(rnd)
        fragment = self._plan.due(self._step_count)
        if self._due_group is not None:
            fragment = self._due_in_replica(fragment)
        averaging = fragment is not None
        for rnd in list(self._in_flight):
            if self._lands_now(rnd) or (averaging and self.must_finish_before(rnd, fragment)):
                self._finish(rnd)
        if averaging:
            self._engine.report_deferred(self)
            rnd = self._launch(overlapped=self._options.overlap, fragment=fragment)
            if not rnd.overlapped:
                self._finish(rnd)
        elif self._step_count == self._options.warmup_steps - 1:
            self._anchor_after_warmup()
        return averaging

    def _anchor_after_warmup(self) -> None:
        """Start the changes from here: the warm-up's averaged gradients kept the replicas
        identical, so the anchors become the current parameters; replicas that differ
        (gradients stayed local during the warm-up) start from their average instead
        (:func:`align_anchors`), with a warning."""
        for bucket in self._engine.buckets:
            bucket.reset_anchor()
        if align_anchors(self._engine.buckets, self.process_group):
            warnings.warn(
                f"the replicas' parameters differ at the end of the warm-up (step "
                f"{self._step_count + 1} of warmup_steps={self._options.warmup_steps}): their "
                "gradients were not averaged during it, or they started apart (FSDP2 "
                "broadcasts nothing across replica groups: build the model after the same "
                "torch.manual_seed everywhere). The changes now start from the replicas' "
                "average, so the first round brings them together; to average gradients "
                "during the warm-up, register grad_hooks.local_sgd_grad_hook as the DDP comm "
                "hook, or call grad_hooks.register_fsdp_grad_hooks for an FSDP2 model",
                stacklevel=3)

    def _due_in_replica(self, fragment: int | None) -> int | None:
        """A time-based round is due on every rank of this replica group once it is due on
        one of them (their clocks differ; their steps may not)."""
        flag = torch.tensor([0 if fragment is None else 1], dtype=torch.int32,
                            device=backend_device(self._due_group))  # NCCL: on the GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._due_group)
        if fragment is None and flag.item():
            return self._plan.rounds % self._plan.fragments
        return fragment

    def average(self) -> None:
        """Average now, outside the schedule (collective; the counter does not move)."""
        self._check_alive("average")
        self.synchronize()
        self._engine.report_deferred(self)
        self._finish(self._launch(overlapped=False))

    def synchronize(self) -> None:
        """Finish the overlapped rounds in flight, if any (waits for them)."""
        for rnd in list(self._in_flight):
            self._finish(rnd)

    @property
    def rounds_in_flight(self) -> list[Round]:
        """The overlapped rounds launched and not yet applied, oldest first."""
        return list(self._in_flight)

    @property
    def planner(self) -> RoundPlanner:
        """Which fragment a step averages, and each rank's local steps (read-only use)."""
        return self._plan

    def _lands_now(self, rnd: Round) -> bool:
        """Whether the current ``step()`` applies ``rnd``, outside the rounds that must
        finish first: once complete, or ``overlap_steps`` steps after its launch."""
        steps = self._options.overlap_steps
        if steps is None:
            return rnd.done()
        return self._step_count - rnd.launch_step >= steps

    def must_finish_before(self, rnd: Round, fragment: int) -> bool:
        """Whether an overlapped round in flight must be applied before ``fragment``'s
        round starts: one of the same fragment (with ``fragments=1``, every one), and
        every one when an observer's report is collective (all ranks must have finished
        the same rounds when it runs)."""
        return rnd.fragment == fragment or self._engine.collective_reports

    def _launch(self, *, overlapped: bool, fragment: int | None = None) -> Round:
        """Launch a round of ``fragment`` (a scheduled one) or of everything (``None``)."""
        where = f"round {self._rounds_started + 1}, step {self._step_count}"
        local_steps = None
        if fragment is not None:
            local_steps = self._plan.local_steps(self._step_count, fragment)
            self._plan.started(self._step_count, fragment)
        try:
            rnd = self._engine.launch(overlapped=overlapped, where=where, fragment=fragment,
                                      local_steps=local_steps)
        except BaseException:
            if fragment is not None:
                self._plan.finished()  # a failed round too: the schedule goes on
            raise
        self._rounds_started += 1
        rnd.launch_step = self._step_count
        if overlapped:
            self._in_flight.append(rnd)
            if self._plan.timed:  # the next round's clock starts as this one completes
                rnd.record_completion(self._plan.clock)
        return rnd

    def _finish(self, rnd: Round) -> None:
        self._in_flight = [r for r in self._in_flight if r is not rnd]
        try:
            self._engine.finish(rnd, self)
        finally:  # a failed round too: the schedule goes on
            if rnd.fragment is not None and not self._in_flight:
                self._plan.finished(rnd.completed_at)

    def memory_bytes(self) -> dict[str, dict[str, int]]:
        """Bytes this registration holds, ``{kind: {device: bytes}}`` (see
        :mod:`ddp_avg_hooks.memory`)."""
        return memory.count(self._engine.buckets, self.state,
                            [b for p in self._engine.policies for b in p.held_buckets()])

    # --- checkpoints ------------------------------------------------------------------
    def config(self) -> dict:
        """What every rank, and a checkpoint being loaded, must agree on: the hook, every
        option in ``AveragingOptions.AGREED``, the averaging group's members, the hook
        state's declared settings (``HookSpec.settings``), the shards and the buckets."""
        opts, spec = self._options, hook_spec(self._engine.hook)
        group = self.process_group
        agreed = {name: getattr(opts, name) for name in AveragingOptions.AGREED
                  if name not in ("period", "process_group", "fragments", "keep_anchor")}
        return {
            "hook": self._engine.name,
            "period": self._schedule.describe(),
            **agreed,
            "fragments": len(self._engine.fragments),
            "keep_anchor": opts.wants_anchor(spec.needs_anchor),
            "group": dist.get_process_group_ranks(group) if is_member(group) else None,
            "hook_settings": self._hook_settings(spec),
            **({"shards": self._model.shards()} if self.sharded else {}),
            "layout": [b.layout() for b in self._engine.buckets],
        }

    def _hook_settings(self, spec) -> dict:
        try:
            return spec.settings_of(self.state)
        except Exception as exc:
            raise TypeError(
                f"averaging hook {self._engine.name!r}: its settings(state) declaration "
                f"raised {type(exc).__name__}: {exc} on the state it was registered with (a "
                f"{type(self.state).__name__}); register the hook with the state its "
                "settings function reads") from exc

    def state_dict(self) -> dict:
        """This rank's averaging state: counter, anchors, hook state, stats, config.

        Tensors and plain values only, so ``torch.save`` takes it; it differs between
        ranks (error feedback, local progress), so save one per rank.
        """
        self._check_alive("state_dict")
        self.synchronize()
        saved = [b.state_dict() for b in self._engine.buckets]
        out = {
            "step_count": self._step_count,
            "next_round": min(self._plan.next_rounds),
            "plan": self._plan.state_dict(),
            "weight_totals": self._engine.weights.state_dict(),
            "config": self.config(),
            "schedule": self._schedule.state_dict(),
            "anchors": [s["anchor"] for s in saved],
            "bucket_memory": [s["memory"] for s in saved],
            "stats": dataclasses.asdict(self.stats),
        }
        if hasattr(self.state, "state_dict"):
            out["hook_state"] = self.state.state_dict()
        return out

    def check_state_dict(self, state_dict) -> None:
        """Raise, changing nothing, if :meth:`load_state_dict` would refuse ``state_dict``.

        ``TypeError`` for something that is not a handle's state dict; ``ValueError``
        naming the first difference when it was made with other settings (hook, period,
        warm-up, fragments, the bucket layout, the shards).
        """
        if not isinstance(state_dict, dict) or not all(k in state_dict for k in _KEYS):
            raise TypeError(
                "load_state_dict: expected the dict returned by AveragingHandle.state_dict(), "
                f"got {type(state_dict).__name__}"
                + (f" with keys {sorted(state_dict)}" if isinstance(state_dict, dict) else "")
            )
        # the settings first: another bucket layout or fragment count also gives entries
        # of other lengths, which are then the consequence, not the damage
        if isinstance(state_dict["config"], dict):
            for key, mine in self.config().items():
                theirs = state_dict["config"].get(key, _ADDED_SETTINGS.get(key))
                if theirs != mine:
                    raise SettingsMismatchError(
                        f"load_state_dict: the checkpoint was made with other settings: "
                        f"{difference(key, theirs, mine)}; register with the same settings "
                        "to resume")
        problem = self._entry_problem(state_dict)
        if problem:
            raise ValueError(f"load_state_dict: the state dict is damaged: {problem}; load "
                             "what AveragingHandle.state_dict() wrote (nothing was changed)")
        for bucket, anchor, kept in zip(self._engine.buckets, state_dict["anchors"],
                                          state_dict["bucket_memory"]):
            bucket.check_state({"anchor": anchor, "memory": kept})
        has_hook_state = hasattr(self.state, "load_state_dict")
        if has_hook_state != ("hook_state" in state_dict):
            raise ValueError(
                "load_state_dict: the checkpoint "
                + ("has no hook state but this hook's state needs one"
                   if has_hook_state else "has a hook state but this hook's state takes none")
            )

    def _entry_problem(self, state_dict: dict) -> str | None:
        """What is wrong with the plain entries of a state dict (the kinds of values
        :meth:`state_dict` writes), else ``None``."""
        def ints(values, at_least=None) -> bool:
            return isinstance(values, (list, tuple)) and all(
                isinstance(v, int) and not isinstance(v, bool)
                and (at_least is None or v >= at_least) for v in values)

        plan, stats = state_dict["plan"], state_dict["stats"]
        n = len(self._engine.buckets)
        checks = [
            ("config", isinstance(state_dict["config"], dict), "a dict"),
            ("step_count", ints([state_dict["step_count"]], 0), "an int >= 0"),
            ("next_round", ints([state_dict["next_round"]]), "an int"),
            ("plan", isinstance(plan, dict) and ints(plan.get("next_rounds"))
             and ints(plan.get("last_rounds")) and ints([plan.get("rounds")], 0),
             "a dict of next_rounds, last_rounds (lists of ints) and rounds"),
            ("stats", isinstance(stats, dict) and all(
                f.name in stats for f in dataclasses.fields(self.stats)),
             f"a dict of {', '.join(f.name for f in dataclasses.fields(self.stats))}"),
            ("weight_totals", isinstance(state_dict["weight_totals"], (list, tuple)) and all(
                t is None or isinstance(t, (int, float)) for t in state_dict["weight_totals"]),
             "a list of numbers or None"),
            ("schedule", isinstance(state_dict["schedule"], dict), "a dict"),
            ("anchors", isinstance(state_dict["anchors"], (list, tuple))
             and len(state_dict["anchors"]) == n, f"a list of {n} (one per bucket)"),
            ("bucket_memory", isinstance(state_dict["bucket_memory"], (list, tuple))
             and len(state_dict["bucket_memory"]) == n, f"a list of {n} (one per bucket)"),
        ]
        for key, ok, expected in checks:
            if not ok:
                return f"{key!r} must be {expected}, got {state_dict[key]!r:.80}"
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved (on this rank, into a fresh handle).

        Checked first by :meth:`check_state_dict`: a checkpoint made with another hook,
        period, warm-up or bucket layout raises ``ValueError`` naming the first
        difference, and nothing is changed then.
        """
        self._check_alive("load_state_dict")
        self.check_state_dict(state_dict)
        self.synchronize()
        if hasattr(self.state, "load_state_dict"):
            self.state.load_state_dict(state_dict["hook_state"])
        self._schedule.load_state_dict(state_dict["schedule"])
        for bucket, anchor, kept in zip(self._engine.buckets, state_dict["anchors"],
                                          state_dict["bucket_memory"]):
            bucket.load_state_dict({"anchor": anchor, "memory": kept})
        for field in dataclasses.fields(self.stats):  # in place: the stats object stays
            setattr(self.stats, field.name, state_dict["stats"][field.name])
        self._step_count = int(state_dict["step_count"])
        self._rounds_started = self.stats.rounds  # a checkpoint holds no round in flight
        self._plan.load_state_dict(state_dict["plan"])
        self._engine.weights.load_state_dict(state_dict["weight_totals"])
        if self.reducer_switch is not None:  # back in the warm-up: gradients averaged again
            self.reducer_switch.follow(self.in_warmup)

    # --- lifecycle --------------------------------------------------------------------
    def _check_alive(self, what: str) -> None:
        if self._removed:
            raise RuntimeError(
                f"AveragingHandle.{what}() after remove(): register the hook again to resume"
            )

    def averages(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the parameters this handle averages (with FSDP2,
        the sharded parameter itself). Gradient hooks use it to refuse another model's
        handle."""
        return self._model is not None and self._model.averages(param)

    def check_optimizer(self, optimizer: torch.optim.Optimizer, who: str = "optimizer") -> None:
        """Raise ``ValueError`` unless ``optimizer`` steps at least one of the parameters
        this handle averages (``who`` names the caller in the message)."""
        if self._model is not None:
            self._model.check_optimizer(optimizer, who)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Run :meth:`step` after every ``optimizer.step()`` (what ``optimizer=`` does).

        One optimizer at a time: a handle already attached (``optimizer=``, or an earlier
        call) raises ``ValueError``, since a second would count every step twice; call
        :meth:`detach_optimizer` first to move it to another optimizer."""
        self._check_alive("attach_optimizer")
        if self._optimizer_hook is not None:
            raise ValueError(
                "AveragingHandle.attach_optimizer: the handle already runs step() after an "
                "optimizer's steps (optimizer= or an earlier attach_optimizer); a second "
                "would count every step twice. Call handle.detach_optimizer() first to "
                "attach it to another optimizer"
            )
        self.check_optimizer(optimizer, "AveragingHandle.attach_optimizer")
        self._optimizer_hook = StepHooks(optimizer, self._advance)

    @property
    def attached_optimizer(self) -> bool:
        """Whether :meth:`step` runs after an optimizer's steps (``optimizer=``)."""
        return self._optimizer_hook is not None

    def detach_optimizer(self) -> None:
        """Stop running :meth:`step` after the optimizer's steps (a no-op if it did not);
        a wrapper that steps the handle itself calls it."""
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None

    def remove(self) -> None:
        """Stop averaging: finish a round in flight, detach from the optimizer, turn DDP's
        gradient reducer back on (call it outside ``ddp.no_sync()``, which on leaving
        restores the value it found), free the buckets, and stop the registration's
        background thread, if overlapped rounds started one (its private process groups
        go to the next registration over the same ranks: remove and register in the same
        order on every rank, as a program the same on every rank does). Idempotent. A
        ``local_sgd_grad_hook`` given this handle then averages gradients every step, or
        follows a handle registered on the model later (:attr:`successor`)."""
        if self._removed:
            return
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if self.reducer_switch is not None:
            self.reducer_switch.release()
        self._stop_counting_forwards()
        try:
            self.synchronize()
        finally:
            self._removed = True
            self._engine.buckets, self._engine.policies = [], []
        self._engine.background.close()  # every round finished: the thread can stop
        callbacks_pending()  # drops what the rounds' callbacks held (the buckets' buffers)

    # --- uneven inputs: torch.distributed.algorithms.join.Join -------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        """What this rank does inside ``Join([ddp, handle])`` once its inputs run out
        (``Join`` calls it; its keyword arguments are DDP's, none is read here)."""
        if self._model is not None and self._model.sharded:
            raise ValueError(
                "Join([...]) with the handle of an FSDP2 model: a rank whose inputs ran out "
                "cannot stand in for FSDP2's all-gathers in the others' forward and "
                "backward. Give every rank the same number of batches (drop_last=True in "
                "the DistributedSampler, or stop all ranks at the smallest count)")
        if self._plan.timed:
            raise ValueError(
                "Join([...]) with time-based rounds (EverySeconds): Join stands in for the "
                "others' steps one for one, while these rounds let ranks take different "
                "numbers of steps already. End the run on a round count instead, on every "
                "rank: while handle.rounds_started < rounds: ...")
        ddp = self._ddp()
        if ddp is not None and ddp.process_group != self.process_group:
            raise ValueError(
                "Join([ddp, handle]): the rounds average over another process group than "
                "DDP's gradients, and Join counts the ranks of one group. Use Join with "
                "the handle of a registration over DDP's group")
        self._forwards = 0
        if ddp is not None and self._forward_counter is None:
            self._forward_counter = ddp.register_forward_pre_hook(self._count_forward)
        return _ShadowSteps(self)

    def _stop_counting_forwards(self) -> None:
        if self._forward_counter is not None:
            self._forward_counter.remove()
            self._forward_counter = None

    @property
    def in_join(self) -> bool:
        """Whether the handle is inside an enabled ``Join`` block now."""
        return self._join_config.enable

    def add_joined_step_hook(self, fn) -> Callable[[], None]:
        """Inside ``Join``, call ``fn()`` on a rank whose inputs ran out after each step it
        takes in place of the others' (where the training loop makes a collective after
        each step, as ``RoundCheckpointer.maybe_save`` does). Returns a function that
        removes it."""
        self._joined_step_hooks.append(fn)
        return lambda: self._joined_step_hooks.remove(fn) if fn in self._joined_step_hooks \
            else None

    @property
    def join_device(self) -> torch.device:
        """The device of ``Join``'s small all-reduces over :attr:`join_process_group`."""
        return backend_device(self.process_group)

    @property
    def join_process_group(self):
        """The group whose ranks ``Join`` counts: the rounds' group."""
        return self.process_group

    def _ddp(self):
        """The DDP wrapper of the averaged model (``None`` for FSDP2, or once it is freed)."""
        return self._model.ddp() if self._model is not None and self._model.ddp else None

    def _count_forward(self, module, args) -> None:
        self._forwards += 1

    def _notify_join(self) -> None:
        """Inside an enabled ``Join``, on a rank still training: check that the DDP model
        comes first and that one forward preceded this step, then tell ``Join`` that this
        rank has not joined (a no-op unless the handle is ``Join``'s first joinable)."""
        ddp = self._ddp()
        where = f"step {self._step_count}"
        if ddp is not None:
            ddp_config = getattr(ddp, "_join_config", None)
            if ddp_config is None or not ddp_config.enable or not ddp_config.is_first_joinable:
                raise RuntimeError(
                    f"AveragingHandle.step() inside Join ({where}): pass the DDP model to "
                    "Join first, Join([ddp, handle, ...]): a rank whose inputs ran out stands "
                    "in for DDP's forward and backward first, then for the round")
            forwards, self._forwards = self._forwards, 0
            if forwards != 1:
                raise RuntimeError(
                    f"AveragingHandle.step() inside Join ({where}) after {forwards} forwards "
                    "of the DDP model since the last step: Join counts each forward as one "
                    "step of the ranks still training, so each step() must follow exactly "
                    "one. Accumulate gradients or evaluate outside the Join, or through "
                    "ddp.module")
        work = Join.notify_join_context(self)
        if work is not None:
            work.wait()

    def __repr__(self) -> str:
        return (
            f"AveragingHandle(hook={self._engine.name}, period={self._schedule!r}, "
            f"warmup_steps={self._options.warmup_steps}, step_count={self._step_count}, "
            f"buckets={len(self._engine.buckets)})"
        )


class _ShadowSteps(JoinHook):
    """Inside ``Join``: a rank whose inputs ran out takes one handle step for each step
    of the ranks still training, so each round still has every rank; when all have
    joined, the rounds in flight are applied and, if there were any, one exact average
    makes the replicas equal again (their late corrections differ)."""

    def __init__(self, handle: AveragingHandle) -> None:
        self._handle = handle

    def main_hook(self) -> None:
        self._handle._advance(joined=True)
        for fn in list(self._handle._joined_step_hooks):
            fn()

    def post_hook(self, is_last_joiner: bool) -> None:
        in_flight = bool(self._handle.rounds_in_flight)
        self._handle.synchronize()
        if in_flight:
            self._handle.average()
        # out of the Join: its rules (one forward a step, DDP first) no longer apply
        self._handle._join_config = _JoinConfig.construct_disabled_join_config()
        self._handle._stop_counting_forwards()
