"""``RoundPlanner`` and ``split_fragments`` against the documented formulas, with an
injected clock for time-based rounds; no process group."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from ddp_avg_hooks.planner import RoundPlanner, split_fragments
from ddp_avg_hooks.schedules import ConstantPeriod, EverySeconds, PostLocalPeriod


def _formula(step: int, warmup: int, period: int, k: int) -> int | None:
    """The fragment averaged at ``step``: ``s >= warmup and (s - warmup - f * period // K)
    % period == 0``."""
    due = [f for f in range(k)
           if step >= warmup and (step - warmup - f * period // k) % period == 0]
    assert len(due) <= 1
    return due[0] if due else None


@pytest.mark.parametrize("period,k,warmup", [(1, 1, 0), (4, 1, 3), (8, 4, 2), (5, 3, 0),
                                             (7, 7, 1), (16, 3, 5)])
def test_step_based_rounds_follow_the_fragment_formula(period, k, warmup):
    plan = RoundPlanner(ConstantPeriod(period), warmup_steps=warmup, fragments=k)
    seen = set()
    for step in range(warmup + 5 * period):
        fragment = plan.due(step)
        assert fragment == _formula(step, warmup, period, k), step
        if fragment is not None:
            # a fragment's weight: the steps since its last round (0 at its first)
            assert plan.local_steps(step, fragment) == (period if fragment in seen else 0)
            seen.add(fragment)
            plan.started(step, fragment)
            plan.finished()


def test_a_schedule_object_decides_the_next_distance():
    plan = RoundPlanner(PostLocalPeriod(period=2, switch_step=6, period_after=5), warmup_steps=1)
    rounds = []
    for step in range(20):
        if plan.due(step) is not None:
            plan.started(step, 0)
            rounds.append(step)
    assert rounds == [1, 3, 5, 7, 12, 17]


def test_a_schedule_that_raises_leaves_the_plan_going():
    class Flaky(ConstantPeriod):
        calls = 0

        def next_period(self, step):
            Flaky.calls += 1
            if Flaky.calls == 2:
                raise ArithmeticError("a bad loss")
            return super().next_period(step)

    plan = RoundPlanner(Flaky(3), warmup_steps=0)
    rounds = []
    for step in range(12):
        if plan.due(step) is not None:
            rounds.append(step)
            with pytest.raises(ArithmeticError) if Flaky.calls == 1 else nullcontext():
                plan.started(step, 0)
    assert rounds == [0, 3, 6, 9]  # the round after the failure at its period in force


def test_time_based_rounds_on_an_injected_clock():
    now = [0.0]
    plan = RoundPlanner(EverySeconds(2.0, clock=lambda: now[0]), warmup_steps=2, fragments=2)
    assert plan.timed and plan.due(0) is None and plan.due(1) is None
    assert plan.due(2) == 0  # the first round: at the warm-up's end, whatever the clock
    plan.started(2, 0)
    assert plan.due(3) is None  # not applied yet
    now[0] = 0.5
    assert plan.in_round_for() == 0.5
    plan.finished()
    now[0] = 1.4
    assert plan.due(4) is None  # a fragment every seconds / K
    now[0] = 1.5
    assert plan.due(4) == 1
    plan.started(4, 1)
    plan.finished(completed_at=1.6)  # the next clock starts when the round completed
    now[0] = 2.5
    assert plan.due(6) is None
    now[0] = 2.6
    assert plan.due(6) == 0 and plan.local_steps(6, 0) == 4


def test_a_resumed_time_based_plan_restarts_its_clock():
    now = [10.0]
    plan = RoundPlanner(EverySeconds(1.0, clock=lambda: now[0]), warmup_steps=0)
    plan.started(0, 0)
    plan.finished()
    saved = plan.state_dict()
    again = RoundPlanner(EverySeconds(1.0, clock=lambda: now[0]), warmup_steps=0)
    again.load_state_dict(saved)
    now[0] = 100.0
    assert again.due(5) is None  # the clock starts at the first step after the restore
    now[0] = 101.0
    assert again.due(6) == 0
    assert saved == {"next_rounds": [0], "last_rounds": [0], "rounds": 1}


def test_state_dict_round_trip_of_a_step_based_plan():
    plan = RoundPlanner(ConstantPeriod(4), warmup_steps=0, fragments=2)
    for step in range(6):
        if (f := plan.due(step)) is not None:
            plan.started(step, f)
    again = RoundPlanner(ConstantPeriod(4), warmup_steps=0, fragments=2)
    again.load_state_dict(plan.state_dict())
    assert [again.due(s) for s in range(6, 12)] == [plan.due(s) for s in range(6, 12)]


def _sizes(parts):
    return [[p.numel() for p in part] for part in parts]


def test_split_fragments_keeps_order_and_balances_elements():
    sizes = [4, 4, 1, 7, 8, 3, 3]
    params = [torch.zeros(n) for n in sizes]
    for k in range(1, len(sizes) + 1):
        parts = split_fragments(params, k)
        assert len(parts) == k and all(parts)
        assert [p for part in parts for p in part] == params  # order kept, nothing split
    # total 30; each cut where the running count comes closest to 30 * f / k (by hand)
    assert _sizes(split_fragments(params, 2)) == [[4, 4, 1, 7], [8, 3, 3]]
    assert _sizes(split_fragments(params, 3)) == [[4, 4, 1], [7, 8], [3, 3]]
    # the parameters left must still fill the fragments left
    assert _sizes(split_fragments([torch.zeros(n) for n in (20, 1, 1)], 3)) == [[20], [1], [1]]
    with pytest.raises(ValueError, match="only 7 parameters"):
        split_fragments(params, 8)


def test_split_fragments_interleaved_deals_the_largest_first_to_the_least_filled():
    sizes = [4, 4, 1, 7, 8, 3, 3]
    params = [torch.zeros(n) for n in sizes]
    for k in range(1, len(sizes) + 1):
        parts = split_fragments(params, k, layout="interleaved")
        assert len(parts) == k and all(parts)
        assert sorted(id(p) for part in parts for p in part) == sorted(map(id, params))
        position = {id(p): i for i, p in enumerate(params)}
        for part in parts:  # each part in the parameters' order
            assert [position[id(p)] for p in part] == sorted(position[id(p)] for p in part)
    # by hand, k=2 (elements a / b): 8->a (8/0), 7->b (8/7), 4->b (8/11), 4->a (12/11),
    # 3->b (12/14), 3->a (15/14), 1->b (15/15)
    assert _sizes(split_fragments(params, 2, layout="interleaved")) == [[4, 8, 3], [4, 1, 7, 3]]
    # k=3 (a / b / c): 8->a, 7->b, 4->c, 4->c (8/7/8), 3->b (8/10/8), 3->a (a and c hold 8
    # elements, a fewer parameters: 11/10/8), 1->c
    assert _sizes(split_fragments(params, 3, layout="interleaved")) == [[8, 3], [7, 3],
                                                                         [4, 4, 1]]
    # empty parameters still leave no part empty: fewer parameters first among equals
    empty = [torch.zeros(0) for _ in range(3)]
    assert all(split_fragments(empty, 3, layout="interleaved"))
    with pytest.raises(ValueError, match="only 7 parameters"):
        split_fragments(params, 8, layout="interleaved")
    with pytest.raises(ValueError, match=r"one of \('contiguous', 'interleaved'\), got 'strided'"):
        split_fragments(params, 2, layout="strided")

