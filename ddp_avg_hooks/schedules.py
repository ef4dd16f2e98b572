"""Period schedules: when the next averaging round comes, decided after each round.

``register_averaging_hook(..., period=...)`` takes an int (a constant period, PyTorch's
``PeriodicModelAverager`` schedule) or one of these objects. After warm-up the first
round runs at step ``warmup_steps``; after a round at step ``s`` the next runs at
``s + schedule.next_period(s)``. Every rank must decide the same, so a schedule may
only depend on the step and on values agreed across ranks.

Example:
    >>> from ddp_avg_hooks.schedules import PostLocalPeriod
    >>> s = PostLocalPeriod(period=2, switch_step=6, period_after=8)
    >>> [s.next_period(step) for step in (0, 4, 6, 14)]
    [2, 2, 8, 8]
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ._checks import check_int


def _check_period(name: str, value) -> int:
    return check_int(name, value, 1)


class PeriodSchedule:
    """Base class: override :meth:`next_period`; keep any state in ``state_dict()``."""

    def bind(self, process_group) -> None:
        """Called once at registration with the averaging group."""

    def next_period(self, step: int) -> int:
        """Steps from the round at ``step`` to the next round (an int >= 1)."""
        raise NotImplementedError

    @property
    def current(self) -> int:
        """The period in force now (for display)."""
        raise NotImplementedError

    def describe(self):
        """What every rank must agree on (compared at registration)."""
        return repr(self)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class ConstantPeriod(PeriodSchedule):
    """Every ``period`` steps: what an int ``period`` means.

    Example:
        >>> ConstantPeriod(4).next_period(100)
        4
    """

    def __init__(self, period: int) -> None:
        self.period = _check_period("period", period)

    def next_period(self, step: int) -> int:
        return self.period

    @property
    def current(self) -> int:
        return self.period

    def describe(self):
        return self.period

    def __repr__(self) -> str:
        return f"ConstantPeriod({self.period})"


class PostLocalPeriod(PeriodSchedule):
    """``period`` until ``switch_step``, then ``period_after`` (e.g. short, then long).

    Example:
        >>> PostLocalPeriod(period=1, switch_step=100, period_after=16).next_period(100)
        16
    """

    def __init__(self, period: int, switch_step: int, period_after: int) -> None:
        self.period = _check_period("period", period)
        self.period_after = _check_period("period_after", period_after)
        self.switch_step = check_int("switch_step", switch_step, 0)
        self._current = period

    def next_period(self, step: int) -> int:
        self._current = self.period if step < self.switch_step else self.period_after
        return self._current

    @property
    def current(self) -> int:
        return self._current

    def __repr__(self) -> str:
        return (f"PostLocalPeriod(period={self.period}, switch_step={self.switch_step}, "
                f"period_after={self.period_after})")


class StepwisePeriod(PeriodSchedule):
    """A period that changes at milestones: ``{step: period}`` (STL-SGD style).

    Grow the period where the learning rate decays: with ``MultiStepLR(milestones=[m1,
    m2])``, ``StepwisePeriod(4, {m1: 8, m2: 16})``.

    Example:
        >>> s = StepwisePeriod(2, {10: 4, 20: 8})
        >>> [s.next_period(step) for step in (0, 9, 10, 25)]
        [2, 2, 4, 8]
    """

    def __init__(self, initial: int, milestones: Mapping[int, int]) -> None:
        self.initial = _check_period("initial", initial)
        if not isinstance(milestones, Mapping):
            raise TypeError(f"milestones must map step -> period, got {type(milestones).__name__}")
        steps = {}
        for k, v in milestones.items():
            try:
                step = None if isinstance(k, bool) else operator.index(k)
            except TypeError:
                step = None
            if step is None or step < 0:
                raise ValueError(f"milestones: each key must be a step, an int >= 0, got {k!r}")
            steps[step] = _check_period(f"milestones[{k}]", v)
        self.milestones = dict(sorted(steps.items()))
        self._current = initial

    def next_period(self, step: int) -> int:
        period = self.initial
        for start, p in self.milestones.items():
            if step >= start:
                period = p
        self._current = period
        return period

    @property
    def current(self) -> int:
        return self._current

    def __repr__(self) -> str:
        return f"StepwisePeriod({self.initial}, {self.milestones})"


class AdaCommPeriod(PeriodSchedule):
    """A period that shrinks as the loss falls (AdaComm, Wang & Joshi 2019).

    Feed it every step's loss with :meth:`observe`. At each round the mean loss since
    the previous round is averaged across ranks (one 2-element allreduce, so every rank
    decides the same) and the next period is
    ``ceil(initial * sqrt(loss / first_loss))``, clamped to ``[min_period, initial]``:
    it follows the loss, so an interval whose mean loss rose lengthens it again.

    Example:
        >>> s = AdaCommPeriod(initial=16, min_period=2)
        >>> s.current
        16
    """

    def __init__(self, initial: int, min_period: int = 1) -> None:
        self.initial = _check_period("initial", initial)
        self.min_period = _check_period("min_period", min_period)
        if min_period > initial:
            raise ValueError(f"min_period ({min_period}) must be <= initial ({initial})")
        self._group = None
        self._sum, self._count = 0.0, 0
        self._first_loss: float | None = None
        self._current = initial

    def bind(self, process_group) -> None:
        self._group = process_group

    def observe(self, loss) -> None:
        """Record one step's loss on this rank (a float or a 0-dim tensor). A nan or inf
        loss (a step that overflowed, which a ``GradScaler`` skips) is left out: the
        period follows the finite ones."""
        try:
            value = float(loss)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(
                "AdaCommPeriod.observe: loss must be a float or a one-element tensor (the "
                f"step's loss, e.g. loss.detach()), got {type(loss).__name__}") from exc
        if math.isfinite(value):
            self._sum += value
            self._count += 1

    def next_period(self, step: int) -> int:
        totals = torch.tensor([self._sum, float(self._count)], dtype=torch.float64)
        if self._group is not None and dist.get_world_size(self._group) > 1:
            dist.all_reduce(totals, group=self._group)
        self._sum, self._count = 0.0, 0
        loss = float(totals[0] / totals[1]) if totals[1] > 0 else math.nan
        if math.isfinite(loss):  # finite losses can still add up past the float range
            if self._first_loss is None:
                self._first_loss = loss
            elif self._first_loss > 0 and loss >= 0:
                ratio = min(math.sqrt(loss / self._first_loss), 1.0)  # above 1: initial
                period = math.ceil(self.initial * ratio)
                self._current = max(self.min_period, min(self.initial, period))
        return self._current

    @property
    def current(self) -> int:
        return self._current

    def describe(self):
        return f"AdaCommPeriod(initial={self.initial}, min_period={self.min_period})"

    def state_dict(self) -> dict:
        return {"sum": self._sum, "count": self._count, "first_loss": self._first_loss,
                "current": self._current}

    def load_state_dict(self, state_dict: dict) -> None:
        keys = ("sum", "count", "first_loss", "current")
        if not isinstance(state_dict, dict) or any(k not in state_dict for k in keys):
            raise ValueError(
                "AdaCommPeriod.load_state_dict: expected what AdaCommPeriod.state_dict() "
                f"returns, a dict with {', '.join(keys)}; got "
                + (f"keys {sorted(state_dict)}" if isinstance(state_dict, dict)
                   else type(state_dict).__name__))
        self._sum, self._count = float(state_dict["sum"]), int(state_dict["count"])
        self._first_loss = state_dict["first_loss"]
        self._current = int(state_dict["current"])

    def __repr__(self) -> str:
        return self.describe()


WEIGHTINGS = ("steps", "equal")


class EverySeconds(PeriodSchedule):
    """Rounds by wall-clock time: a rank enters the next round once ``seconds`` have
    passed on its own clock since it left the previous one.

    Rounds are matched by order, not by step: a fast rank takes more local steps
    between two rounds instead of waiting for a slow one. The first round is at step
    ``warmup_steps`` (on every rank). With ``fragments=K`` the fragments take turns,
    one every ``seconds / K``, so each is averaged every ``seconds``.

    ``weighting`` decides how the ranks' parameters are combined:

    * ``"steps"`` (default): each rank weighs by the local steps it took since the last
      round of those parameters, ``avg = anchor - sum_r w_r delta_r / sum_r w_r``. A
      rank that did twice the work moves the average twice as far; equal steps give the
      plain average. A 1-element allreduce per round sums the steps (and fails, naming
      the round, when a rank has stopped). A hook declared ``linear`` (every built-in
      average; not ``outer_optimizer``) does not wait for it: it starts at once from the
      previous round's total, and the result's change is rescaled to the true total
      before it is applied. Other hooks, and each fragment's first two rounds, wait for
      the total first. Needs anchors, which the handle then keeps. A round in which no
      rank stepped (a first round with no warm-up, say) is the plain average.
    * ``"equal"``: the plain average, whatever the steps. With unequal local steps this
      optimizes a different objective: FedNova (Wang et al. 2020) shows plain averaging
      of unequal amounts of local work is biased towards the objectives of the ranks
      that did more steps; weighting by steps removes that bias for SGD-like updates.

    With ``overlap=True`` a rank trains on while a round is in flight (so a fast rank
    does not wait for a slow one to enter it), and the clock of the next round starts
    when the round completes, an instant all ranks share: one round is in flight at a
    time, and the ranks' clocks start together at every round instead of drifting
    apart. A round in flight for a whole period (``seconds``) is waited for.

    Gradients must not be synchronized per step after the warm-up (ranks take different
    numbers of steps): register ``grad_hooks.local_sgd_grad_hook`` on the DDP model.

    Steps rather than samples: ``handle.step()`` sees steps, not batch sizes, and with
    equal batch sizes the two are the same weight.

    Ending a run: every rank must stop after the same round, since rounds are
    collective. Loop on the round count, ``while handle.rounds_started < rounds:``, not
    on a step count (ranks reach different step counts). A rank that stops early makes
    the others' next round fail with an ``AveragingHookError`` naming the round, within
    the process group's timeout.

    ``clock`` is what each rank reads the time from: seconds, monotonic
    (``time.monotonic`` by default; a test passes its own).

    Example:
        >>> EverySeconds(2.5)
        EverySeconds(2.5, weighting='steps')
    """

    def __init__(self, seconds: float, weighting: str = "steps", *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise TypeError(f"EverySeconds: seconds must be a number, got {type(seconds).__name__}")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"EverySeconds: seconds must be > 0 and finite, got {seconds}")
        if weighting not in WEIGHTINGS:
            raise ValueError(
                f"EverySeconds: weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if not callable(clock):
            raise TypeError("EverySeconds: clock must be callable() -> seconds, got "
                            f"{type(clock).__name__}")
        self.seconds, self.weighting, self.clock = float(seconds), weighting, clock

    @property
    def weighted(self) -> bool:
        """Whether rounds weigh ranks by their local steps."""
        return self.weighting == "steps"

    def next_period(self, step: int) -> int:
        raise TypeError("EverySeconds decides rounds by time, not by a step count")

    @property
    def current(self):
        """``None``: there is no period in steps."""
        return None

    def __repr__(self) -> str:
        return f"EverySeconds({self.seconds}, weighting={self.weighting!r})"


def as_schedule(period) -> PeriodSchedule:
    """An int becomes a :class:`ConstantPeriod`; a schedule passes through."""
    if isinstance(period, PeriodSchedule):
        return period
    return ConstantPeriod(period)
