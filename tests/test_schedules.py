"""Period schedules: the distance each decides after a round, their checks and state."""

from __future__ import annotations

import time

import pytest
import torch

import ddp_avg_hooks as dah
from ddp_avg_hooks.schedules import (AdaCommPeriod, ConstantPeriod, EverySeconds,
                                     PostLocalPeriod, StepwisePeriod, as_schedule)


def test_step_schedules():
    assert [ConstantPeriod(4).next_period(s) for s in (0, 99)] == [4, 4]
    post = PostLocalPeriod(period=2, switch_step=6, period_after=8)
    assert [post.next_period(s) for s in (0, 5, 6, 30)] == [2, 2, 8, 8] and post.current == 8
    step = StepwisePeriod(2, {10: 4, 20: 8})
    assert [step.next_period(s) for s in (0, 9, 10, 19, 20, 99)] == [2, 2, 4, 4, 8, 8]
    assert as_schedule(3).current == 3 and as_schedule(post) is post


@pytest.mark.parametrize("make, error, message", [
    (lambda: ConstantPeriod(0), ValueError, "period must be >= 1"),
    (lambda: ConstantPeriod(True), TypeError, "period must be an int"),
    (lambda: StepwisePeriod(2, [(10, 4)]), TypeError, "milestones must map step -> period"),
    (lambda: StepwisePeriod(2, {-5: 4}), ValueError, "each key must be a step, an int >= 0"),
    (lambda: StepwisePeriod(2, {"10": 4}), ValueError, "each key must be a step"),
    (lambda: AdaCommPeriod(4, min_period=8), ValueError, r"min_period \(8\) must be <= initial"),
    (lambda: EverySeconds(0), ValueError, "seconds must be > 0 and finite"),
    (lambda: EverySeconds(float("inf")), ValueError, "seconds must be > 0 and finite"),
    (lambda: EverySeconds(1, weighting="samples"), ValueError, "weighting must be one of"),
    (lambda: EverySeconds(1, clock=3), TypeError, "clock must be callable"),
])
def test_bad_schedules_say_what_is_wrong(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_adacomm_shrinks_the_period_as_the_loss_falls(world1):
    import torch.distributed as dist

    s = AdaCommPeriod(initial=16, min_period=2)
    s.bind(dist.group.WORLD)
    for loss in (4.0, 4.0):
        s.observe(loss)
    assert s.next_period(0) == 16  # the first mean loss is the reference
    s.observe(1.0)
    assert s.next_period(16) == 8  # ceil(16 * sqrt(1 / 4))
    s.observe(0.0001)
    assert s.next_period(24) == 2  # clamped to min_period
    again = AdaCommPeriod(initial=16, min_period=2)
    again.load_state_dict(s.state_dict())
    assert again.current == 2 and again.state_dict() == s.state_dict()


def test_adacomm_leaves_out_nonfinite_losses(world1):
    import torch.distributed as dist

    s = AdaCommPeriod(initial=16, min_period=2)
    s.bind(dist.group.WORLD)
    for loss in (float("nan"), 4.0, float("inf")):  # an overflowing first step, say
        s.observe(loss)
    assert s.next_period(0) == 16 and s.state_dict()["first_loss"] == 4.0
    s.observe(float("inf"))  # a round of overflows only: the period stays
    assert s.next_period(16) == 16
    s.observe(torch.tensor(1.0))
    assert s.next_period(32) == 8  # ceil(16 * sqrt(1 / 4)), the inf and nan left out
    with pytest.raises(TypeError, match="loss must be a float or a one-element tensor"):
        s.observe([1.0])
    with pytest.raises(ValueError, match="expected what AdaCommPeriod.state_dict"):
        s.load_state_dict({})


def test_adacomm_schedules_every_round_after_an_inf_loss(world1):
    model = torch.nn.Linear(3, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    schedule = AdaCommPeriod(initial=4)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=schedule,
                                         optimizer=opt)
    for step in range(40):
        opt.zero_grad()
        loss = ddp(torch.ones(2, 3)).pow(2).mean()
        loss.backward()
        schedule.observe(float("inf") if step == 2 else loss.detach())
        opt.step()
    assert handle.stats.rounds >= 10  # one every 4 steps or sooner
    handle.remove()


def test_every_seconds_reads_its_clock():
    ticks = iter([5.0, 6.5])
    s = EverySeconds(2.5, weighting="equal", clock=lambda: next(ticks))
    assert s.clock() == 5.0 and s.clock() == 6.5
    assert not s.weighted and s.current is None
    assert repr(s) == "EverySeconds(2.5, weighting='equal')"
    assert EverySeconds(1.0).clock is time.monotonic
    with pytest.raises(TypeError, match="by time, not by a step count"):
        s.next_period(0)
