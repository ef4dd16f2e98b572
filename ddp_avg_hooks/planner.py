"""``RoundPlanner``: which fragment of the model a step averages, and with what weight.

A registration's parameters are split into ``fragments`` parts (see
:func:`split_fragments`); each part is averaged on its own schedule:

* **step-based** (an int ``period`` or a schedule object): fragment ``f`` is averaged at
  step ``s`` iff ``s >= warmup_steps and (s - warmup_steps - f * period // K) % period ==
  0``. With ``K = 1`` that is PyTorch's ``PeriodicModelAverager`` schedule; a schedule
  object decides the distance to the next round after each round (``K = 1`` only).
* **time-based** (:class:`~ddp_avg_hooks.schedules.EverySeconds`): the first round is at
  step ``warmup_steps``; after that a rank enters the next round once ``seconds / K``
  have passed on its own clock since it finished the previous one (with overlap:
  since the previous one completed). Rounds are matched by order, fragment ``k % K``
  at round ``k``; ranks may enter them at different steps.

Example:
    >>> from ddp_avg_hooks.planner import RoundPlanner
    >>> from ddp_avg_hooks.schedules import ConstantPeriod
    >>> plan = RoundPlanner(ConstantPeriod(8), warmup_steps=2, fragments=4)
    >>> rounds = []
    >>> for s in range(2, 12):
    ...     f = plan.due(s)
    ...     if f is not None:
    ...         plan.started(s, f); rounds.append((s, f))
    >>> rounds
    [(2, 0), (4, 1), (6, 2), (8, 3), (10, 0)]
"""

from __future__ import annotations

import time

import torch

from .schedules import EverySeconds, PeriodSchedule


FRAGMENT_LAYOUTS = ("contiguous", "interleaved")


def check_fragment_layout(layout, name: str = "layout") -> str:
    """``layout`` if it is one of ``FRAGMENT_LAYOUTS``, else ``ValueError`` naming ``name``."""
    if layout not in FRAGMENT_LAYOUTS:
        raise ValueError(f"{name} must be one of {FRAGMENT_LAYOUTS}, got {layout!r}")
    return layout


def split_fragments(params: list[torch.Tensor], fragments: int, *,
                    allow_empty: bool = False,
                    layout: str = "contiguous") -> list[list[torch.Tensor]]:
    """``params`` dealt into ``fragments`` parts of near-equal element count.

    A parameter is never split, and each part keeps the parameters' order.

    * ``layout="contiguous"``: ``params`` in order, cut where the running count comes
      closest to an equal share; a part holds neighbouring layers.
    * ``layout="interleaved"``: the largest parameter first (in order among equals),
      each to the part with the fewest elements so far, then the fewest parameters
      (the lowest index among equals); every part takes layers from all over the model.

    Raises ``ValueError`` when there are fewer parameters than fragments, unless
    ``allow_empty`` (a rank's local shards of an FSDP2 model: the last fragments are
    then empty, on this rank and on the ranks it averages with).

    Example:
        >>> import torch
        >>> sizes = [4, 4, 1, 7, 8]
        >>> ps = [torch.zeros(n) for n in sizes]
        >>> [[p.numel() for p in f] for f in split_fragments(ps, 2)]
        [[4, 4, 1], [7, 8]]
        >>> [[p.numel() for p in f] for f in split_fragments(ps, 2, layout="interleaved")]
        [[4, 8], [4, 1, 7]]
    """
    check_fragment_layout(layout)
    if fragments > len(params) and allow_empty:
        return [[p] for p in params] + [[] for _ in range(fragments - len(params))]
    if fragments > len(params):
        raise ValueError(
            f"fragments={fragments} but the model has only {len(params)} parameters to "
            "average (a parameter is never split): use fragments <= the parameter count"
        )
    if layout == "interleaved":
        return _interleaved(params, fragments)
    total = sum(p.numel() for p in params)
    parts: list[list[torch.Tensor]] = [[] for _ in range(fragments)]
    f, running = 0, 0
    for i, p in enumerate(params):
        left_after = len(params) - i - 1
        target = total * (f + 1) / fragments
        if parts[f] and f < fragments - 1:
            stay, move = abs(running + p.numel() - target), abs(running - target)
            # the parameters left must still fill the fragments left
            if move < stay or left_after < fragments - f - 1:
                f += 1
        parts[f].append(p)
        running += p.numel()
    return parts


def _interleaved(params: list[torch.Tensor], fragments: int) -> list[list[torch.Tensor]]:
    """Largest first, each to the least-filled part; every part keeps ``params``' order."""
    filled = [(0, 0)] * fragments  # (elements, parameters) per part
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        f = min(range(fragments), key=lambda f: filled[f])
        owner[i] = f
        filled[f] = (filled[f][0] + params[i].numel(), filled[f][1] + 1)
    return [[p for i, p in enumerate(params) if owner[i] == f] for f in range(fragments)]


class RoundPlanner:
    """Decides, step by step, which fragment (if any) a round averages.

    Args:
        schedule: a :class:`~ddp_avg_hooks.schedules.PeriodSchedule` (``EverySeconds``
            for time-based rounds).
        warmup_steps: steps before the first round.
        fragments: how many fragments take turns (``>= 1``).
        clock: seconds, monotonic (default: ``EverySeconds``' own clock).

    The settings are checked by :class:`~ddp_avg_hooks.options.AveragingOptions`: with
    ``fragments > 1`` the schedule is an int period of at least ``fragments`` steps or
    an ``EverySeconds``.
    """

    def __init__(self, schedule: PeriodSchedule, *, warmup_steps: int, fragments: int = 1,
                 clock=None) -> None:
        self.schedule, self.warmup_steps, self.fragments = schedule, warmup_steps, fragments
        self.timed = isinstance(schedule, EverySeconds)
        self._clock = clock or (schedule.clock if self.timed else time.monotonic)
        offsets = [0] * fragments if self.timed else \
            [f * schedule.current // fragments for f in range(fragments)]
        self.next_rounds = [warmup_steps + o for o in offsets]
        self.last_rounds = list(self.next_rounds)  # step of each fragment's last round
        self.rounds = 0
        self._last_finish: float | None = None
        self._launched: float | None = None  # when the round not yet applied began

    def due(self, step: int) -> int | None:
        """The fragment a round at ``step`` averages, or ``None`` for no round."""
        if not self.timed:
            for f, s in enumerate(self.next_rounds):
                if s == step:
                    return f
            return None
        if step < self.warmup_steps:
            return None
        if self.rounds == 0:
            return 0
        if self._last_finish is None:  # resumed from a checkpoint: restart the clock
            self._last_finish = self._clock()
        if self._launched is not None:  # the last round is not applied yet
            return None
        elapsed = self._clock() - self._last_finish
        if elapsed < self.schedule.seconds / self.fragments:
            return None
        return self.rounds % self.fragments

    def in_round_for(self) -> float:
        """Time-based rounds: seconds since the round not yet applied began (0: none)."""
        return 0.0 if self._launched is None else self._clock() - self._launched

    def local_steps(self, step: int, fragment: int) -> int:
        """Steps this rank took since ``fragment``'s last round (its weight)."""
        return step - self.last_rounds[fragment]

    def started(self, step: int, fragment: int) -> None:
        """A round of ``fragment`` began at ``step``."""
        self.rounds += 1
        self.last_rounds[fragment] = step
        if not self.timed:
            try:
                distance = self.schedule.next_period(step)
            except BaseException:
                # a schedule that raised: the next round comes after the period in
                # force, so the plan never points at a step already past
                self.next_rounds[fragment] = step + max(1, int(self.schedule.current or 1))
                raise
            self.next_rounds[fragment] = step + distance
        else:
            self._launched = self._clock()

    def clock(self) -> float:
        return self._clock()

    def finished(self, completed_at: float | None = None) -> None:
        """Every round launched is applied on this rank; the clock of the next starts at
        ``completed_at`` (when the last one completed; default: now)."""
        self._launched = None
        self._last_finish = self._clock() if completed_at is None else completed_at

    def state_dict(self) -> dict:
        return {"next_rounds": list(self.next_rounds), "last_rounds": list(self.last_rounds),
                "rounds": self.rounds}

    def load_state_dict(self, state: dict) -> None:
        self.next_rounds = [int(s) for s in state["next_rounds"]]
        self.last_rounds = [int(s) for s in state["last_rounds"]]
        self.rounds = int(state["rounds"])
        self._last_finish = self._launched = None
