"""schedules.EverySeconds: rounds by each rank's clock, matched by order, weighted by work."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import flat, make_model, train_step
from ddp_avg_hooks.schedules import EverySeconds


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _rank_uneven(rank, world_size, weighting, hook_name, rounds, sleep_s):
    """Rank 1 sleeps longer per step. At each round, every rank's parameters, anchor
    and local steps are gathered first, to check the result against the closed form."""
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # one reading per step, so that is_averaging_step() and step() agree; from the start of
    # a round on, the real clock, so that its completion is stamped when it completes
    now = [time.monotonic()]
    hook = getattr(dah.hooks, hook_name)

    @functools.wraps(hook)
    def hook_on_real_clock(state, bucket):
        now[0] = None
        return hook(state, bucket)

    clock = lambda: time.monotonic() if now[0] is None else now[0]  # noqa: E731
    handle = dah.register_averaging_hook(ddp, hook_on_real_clock, None,
                                         period=EverySeconds(0.3, weighting=weighting, clock=clock),
                                         warmup_steps=2)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    step, last_round_step, checks = 0, 2, []
    anchor = None
    while handle.rounds_started < rounds:
        train_step(ddp, opt, rank, step)
        time.sleep(sleep_s[rank])
        now[0] = time.monotonic()
        if handle.is_averaging_step() and handle.rounds_started > 0:
            mine = flat(model).double()
            ps = _gather(mine)
            steps = _gather(torch.tensor([float(step - last_round_step)], dtype=torch.float64))
            w = torch.cat(steps)
            if weighting == "equal" or w.sum() == 0:
                w = torch.ones_like(w)
            expected = anchor + sum(wi * (p - anchor) for wi, p in zip(w, ps)) / w.sum()
            assert handle.step()
            last_round_step = step
            got = flat(model)
            same = _gather(got)
            checks.append((all(torch.equal(same[0], s) for s in same),
                           float((got.double() - expected).abs().max()), w.tolist()))
        else:
            if handle.step():
                last_round_step = step
        if handle.rounds_started and last_round_step == step:
            anchor = flat(model).double()
        step += 1
    return {"steps": step, "rounds": handle.stats.rounds, "checks": checks}


@pytest.mark.parametrize("weighting,hook_name", [("steps", "allreduce_hook"),
                                                 ("equal", "allreduce_hook"),
                                                 ("steps", "fp16_compress_hook")])
def test_fast_rank_takes_more_steps_and_rounds_match(weighting, hook_name):
    # the slow rank sleeps 80 ms a step: well above a step's compute even on a loaded machine
    fast, slow = run_ranks(_rank_uneven, 2, weighting=weighting, hook_name=hook_name, rounds=5,
                           sleep_s=(0.0, 0.08))
    assert fast["rounds"] == slow["rounds"] == 5
    assert fast["steps"] > 1.25 * slow["steps"], (fast["steps"], slow["steps"])
    tol = 1e-6 if hook_name == "allreduce_hook" else 2e-3  # fp16: a half-precision delta
    for identical, err, weights in fast["checks"]:
        assert identical and err <= tol, (err, weights)
    if weighting == "steps":  # the rounds did weigh unequal work
        assert any(w[0] > w[1] for _, _, w in fast["checks"])


def _rank_stops_early(rank, world_size, overlap):
    model = make_model()
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=EverySeconds(0.05), overlap=overlap)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    try:
        while handle.rounds_started < (2 if rank == 1 else 4):
            train_step(ddp, opt, rank, step)
            handle.step()
            step += 1
        handle.synchronize()  # rank 1 finishes its last round in flight, then stops
    except dah.AveragingHookError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_rank_that_stops_early_is_an_error_naming_the_round(overlap):
    # with overlap, round 3 is launched without waiting; the wait for it (held back
    # for one period at most) is where the error comes out, naming that round
    messages = run_ranks(_rank_stops_early, 2, pg_timeout_s=5, hard_exit=True, overlap=overlap)
    assert messages[1] is None
    assert "round 3" in messages[0] and "rounds_started" in messages[0], messages[0]


def _rank_resume(rank, world_size, tmp):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=EverySeconds(0.1), warmup_steps=1)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    step = 0
    while handle.rounds_started < 2:
        train_step(ddp, opt, rank, step)
        time.sleep(0.02 * rank)
        handle.step()
        step += 1
    for _ in range(3):  # local steps past the round, carried into the next weight
        train_step(ddp, opt, rank, step)
        handle.step()
        step += 1
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "handle": handle.state_dict()}
    handle.remove()

    model2 = make_model(seed=9)
    ddp2 = DDP(model2)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    again = dah.register_averaging_hook(ddp2, dah.hooks.allreduce_hook, None,
                                        period=EverySeconds(0.1), warmup_steps=1)
    ddp2.register_comm_hook(again, dah.grad_hooks.local_sgd_grad_hook)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    again.load_state_dict(saved["handle"])
    resumed = (again.step_count, again.rounds_started,
               again.planner.local_steps(again.step_count, 0))
    totals = saved["handle"]["weight_totals"]
    assert again.state_dict()["weight_totals"] == totals and totals[0] > 0
    while again.rounds_started < 4:
        train_step(ddp2, opt2, rank, step)
        again.step()
        step += 1
    same = _gather(flat(model2))
    return resumed, step, torch.equal(same[0], same[1])


def test_state_dict_resumes_mid_run(tmp_path):
    results = run_ranks(_rank_resume, 2, tmp=str(tmp_path))
    for rank, (resumed, steps, identical) in enumerate(results):
        step_count, rounds, local_steps = resumed
        assert rounds == 2 and local_steps >= 3
        assert steps > step_count and identical


def test_bad_arguments_are_clear(world1):
    with pytest.raises(ValueError, match="seconds must be > 0"):
        EverySeconds(0)
    with pytest.raises(ValueError, match="weighting must be one of"):
        EverySeconds(1.0, weighting="samples")
    with pytest.raises(TypeError, match="seconds must be a number"):
        EverySeconds("1")
    ddp = DDP(make_model())
    with pytest.raises(ValueError, match="weighting='equal'"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                    period=EverySeconds(1.0), zero_copy=True)
    with pytest.raises(ValueError, match="needs anchors"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                    period=EverySeconds(1.0), keep_anchor=False)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=EverySeconds(1.0, weighting="equal"),
                                         zero_copy=True)
    assert handle.period is None and handle.step()  # the first round: step warmup_steps
    assert not handle.step()  # a second has not passed
    handle.remove()


def _rank_fragments_overlap(rank, world_size):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook, None,
                                         period=EverySeconds(0.1), fragments=2, overlap=True)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    step, fragments_seen = 0, []
    while handle.rounds_started < 6:
        train_step(ddp, opt, rank, step)
        time.sleep(0.01 * rank)
        before = handle.rounds_started
        handle.step()
        if handle.rounds_started > before:
            fragments_seen.append(handle.planner.rounds % 2)
        step += 1
    handle.synchronize()
    anchors = torch.cat([b.anchor() for b in handle.buckets])
    same = _gather(anchors)
    return step, handle.stats.rounds, torch.equal(same[0], same[1]), fragments_seen


def test_time_based_rounds_take_turns_over_fragments_with_overlap():
    (fast_steps, fast_rounds, same, seen), (slow_steps, slow_rounds, _, _) = run_ranks(
        _rank_fragments_overlap, 2)
    assert fast_rounds == slow_rounds == 6 and same
    assert seen == [1, 0, 1, 0, 1, 0]  # fragment 0, 1, 0, ... (counted after each launch)
    assert fast_steps > slow_steps


def _store():
    return dist.distributed_c10d._get_default_store()


class _Ranks:
    """One rank of a two-rank run on a clock the test moves: a round is due only when
    the test moves the clock a period ahead."""

    def __init__(self, rank, hook=dah.hooks.fp16_compress_hook, **options):
        self.rank, self.model = rank, make_model()
        self.ddp = DDP(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.now = [0.0]
        self.handle = dah.register_averaging_hook(
            self.ddp, hook, None, period=EverySeconds(1.0, clock=lambda: self.now[0]),
            overlap=True, **options)
        self.ddp.register_comm_hook(self.handle, dah.grad_hooks.local_sgd_grad_hook)
        self.steps, self.last_round = 0, 0

    def step(self, *, advance: float = 0.0, trained: bool = False) -> bool:
        if not trained:
            train_step(self.ddp, self.opt, self.rank, self.steps)
        self.now[0] += advance
        at = self.handle.step_count
        entered = self.handle.step()
        if entered:
            self.last_round = at
        self.steps += 1
        return entered

    def enter(self, *, trained: bool = False) -> int:
        """Move the clock a period on and step, until a round starts (a round in flight
        is applied first, and its clock starts then); the steps taken."""
        for steps in range(1, 6):
            if self.step(advance=1.0, trained=trained and steps == 1):
                return steps
        raise AssertionError("no round started within 5 periods")

    def local_steps(self, n: int, *, then_enter: bool) -> None:
        for _ in range(n):
            assert not self.step()
        if then_enter:
            self.enter()


def _rank_counts_in_flight(rank, world_size, hook_name):
    """Rounds 1-2 agree on the step counts first (no earlier total to start from);
    round 3 starts on rank 0 before rank 1 has even entered it."""
    r = _Ranks(rank, getattr(dah.hooks, hook_name))
    r.local_steps(0, then_enter=True)
    r.handle.synchronize()
    r.local_steps(3 + rank, then_enter=True)
    r.handle.synchronize()
    r.local_steps(4 if rank == 0 else 1, then_enter=False)
    train_step(r.ddp, r.opt, rank, r.steps)
    anchor = torch.cat([b.anchor() for b in r.handle.buckets]).double()
    launch = _gather(flat(r.model).double())
    steps_since = _gather(torch.tensor([r.handle.step_count - r.last_round]))
    w = torch.tensor([float(x) for x in steps_since])
    if rank == 1:
        _store().wait(["entered"])  # rank 0 is in round 3, alone
    assert r.enter(trained=True) == 1  # nothing in flight: at once
    if rank == 0:
        _store().set("entered", "1")
    r.handle.synchronize()
    got = torch.cat([b.anchor() for b in r.handle.buckets])
    expected = anchor + sum(wi * (p - anchor) for wi, p in zip(w, launch)) / w.sum()
    return w.tolist(), float((got.double() - expected).abs().max()), _gather(got)


@pytest.mark.parametrize("hook_name", ["allreduce_hook", "fp16_compress_hook"])
def test_weighted_rounds_start_before_the_step_counts_are_in(hook_name):
    (w, err, anchors), _ = run_ranks(_rank_counts_in_flight, 2, pg_timeout_s=30,
                                     hook_name=hook_name)
    assert w == [5.0, 2.0] and torch.equal(anchors[0], anchors[1])
    assert err <= (1e-6 if hook_name == "allreduce_hook" else 2e-3), err


def _rank_clock_starts_when_applied(rank, world_size):
    """Rank 0 trains on while its round 3 waits for rank 1; no round is due until round
    3 is applied, which a whole period in flight makes rank 0 wait for."""
    r = _Ranks(rank)
    r.local_steps(0, then_enter=True)
    r.local_steps(2, then_enter=True)
    r.handle.synchronize()
    held = []
    if rank == 0:
        r.local_steps(2, then_enter=True)  # round 3, alone
        held = [r.step(advance=0.5), r.step(), r.step(advance=0.4)]
        _store().set("held", "1")
        held.append(r.step(advance=0.1))  # a period in flight: waits for round 3
        held.append(r.handle.stats.rounds)
        r.enter()
    else:
        _store().wait(["held"])
        r.local_steps(1, then_enter=True)
        r.enter()
    r.handle.synchronize()
    anchors = _gather(torch.cat([b.anchor() for b in r.handle.buckets]))
    return held, r.handle.rounds_started, r.handle.stats.rounds, torch.equal(*anchors)


def test_an_overlapped_round_starts_the_next_ones_clock_when_applied():
    (held, started, done, same), (_, started1, done1, _) = run_ranks(
        _rank_clock_starts_when_applied, 2, pg_timeout_s=30)
    assert held == [False, False, False, False, 3]
    assert started == started1 == done == done1 == 4 and same


def test_the_built_in_averages_are_declared_linear(world1):
    hooks = dah.hooks
    linear = [hooks.allreduce_hook, hooks.fp16_compress_hook, hooks.bf16_compress_hook,
              hooks.int8_compress_hook, hooks.int4_compress_hook, hooks.powersgd_hook]
    assert all(dah.hook_spec(h).linear for h in linear)
    assert not dah.hook_spec(hooks.outer_optimizer(hooks.fp16_compress_hook)).linear
    assert not dah.hook_spec(lambda state, bucket: None).linear


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_round_does_not_stop_the_clock(world1, overlap):
    calls = []

    def flaky(state, bucket):
        calls.append(bucket.index())
        if len(calls) == 2:
            raise RuntimeError("boom")
        return dah.hooks.allreduce_hook(None, bucket)

    ddp = DDP(make_model())
    now = [0.0]
    handle = dah.register_averaging_hook(
        ddp, flaky, None, overlap=overlap,
        period=EverySeconds(1.0, weighting="equal", clock=lambda: now[0]))
    assert handle.step()  # round 1, at step 0
    handle.synchronize()
    now[0] += 1.0
    with pytest.raises(dah.AveragingHookError, match="boom"):
        handle.step()  # round 2 fails
    assert not handle.step()  # the clock restarted as it failed
    now[0] += 1.0
    assert handle.step() and len(calls) == 3
    handle.remove()
