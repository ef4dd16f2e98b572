"""Each rank's weight in a round weighted by work (``EverySeconds(weighting="steps")``).

A rank's weight is its local steps ``w`` since the fragment's last round; the round
averages ``anchor - sum_r w_r delta_r / sum_r w_r``. Hooks see their rank's change
scaled by ``n * w / W`` (``n`` ranks), so that their plain average is the weighted one.
``W = sum_r w_r`` takes a collective, and waiting for it would hold a fast rank at
every round until the slowest one arrives. So:

* a hook declared ``linear`` starts at once, with the fragment's total of its previous
  round, ``W_ref``, in place of ``W`` (the same on every rank); the total is summed
  beside the round, and its result's change from the anchor is multiplied by
  ``W_ref / W`` before it is written back;
* the first two rounds of a fragment (no usable ``W_ref`` yet: the first has no local
  steps) and any hook not declared ``linear`` wait for ``W`` first.

Example:
    >>> RoundWeights(world=2, fragments=1, linear=True).totals
    [None]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import AveragingHookError

_STOPPED = ("Every rank must run the same rounds: with EverySeconds, end the loop on "
            "handle.rounds_started, not on a step count")


class WeightExchange:
    """The sum of the ranks' local steps for one round, in flight."""

    __slots__ = ("work", "total", "reference", "fragment")

    def __init__(self, work, total: torch.Tensor, reference: float, fragment: int) -> None:
        self.work, self.total, self.reference, self.fragment = work, total, reference, fragment

    def done(self) -> bool:
        return self.work.is_completed()


class RoundWeights:
    """Agrees on the ranks' total work per round; one per handle.

    Args:
        world: ranks in the averaging group.
        fragments: fragments taking turns (each has its own total).
        linear: the hook is declared ``linear`` (see :class:`~ddp_avg_hooks.HookSpec`).
    """

    def __init__(self, *, world: int, fragments: int, linear: bool) -> None:
        self.world, self.linear = world, linear
        self.totals: list[float | None] = [None] * fragments  # each fragment's last total

    def start(self, mine: int, fragment: int, group,
              where: str) -> tuple[float, WeightExchange | None]:
        """This rank's ``delta_scale`` for a round of ``fragment``, and the exchange in
        flight when the scale is provisional (see the module)."""
        reference = self.totals[fragment]
        provisional = self.linear and reference is not None and reference > 0
        total = torch.tensor([float(mine)], dtype=torch.float64)
        try:
            work = dist.all_reduce(total, group=group, async_op=provisional)
        except Exception as exc:
            raise self._error(where, exc) from exc
        if provisional:
            return self.world * mine / reference, WeightExchange(work, total, reference, fragment)
        self.totals[fragment] = float(total)
        return (1.0 if float(total) <= 0 else self.world * mine / float(total)), None

    def correction(self, exchange: WeightExchange, where: str) -> float:
        """``W_ref / W`` once the exchange is complete (waits for it)."""
        try:
            exchange.work.wait()
        except Exception as exc:
            raise self._error(where, exc) from exc
        total = float(exchange.total)
        self.totals[exchange.fragment] = total
        return 1.0 if total <= 0 else exchange.reference / total

    @staticmethod
    def _error(where: str, exc: Exception) -> AveragingHookError:
        return AveragingHookError(
            f"{where}: could not agree on the ranks' local steps with the other ranks "
            f"({type(exc).__name__}: {exc}). {_STOPPED}")

    def state_dict(self) -> list[float | None]:
        return list(self.totals)

    def load_state_dict(self, totals) -> None:
        self.totals = [None if t is None else float(t) for t in totals]
