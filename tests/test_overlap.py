"""overlap=True: rounds launched asynchronously, applied later keeping local progress."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))


def _set(model, fn):
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(fn(i, p))


def _base(i, p):
    g = torch.Generator().manual_seed(i)
    return torch.randint(-8, 8, p.shape, generator=g).float()


def _rank_overlap_formula(rank, world_size):
    ws = world_size
    blocking_model, overlap_model = _model(), _model()
    blocking = dah.register_averaging_hook(DDP(blocking_model), dah.hooks.allreduce_hook, None,
                                           period=2)
    overlapped = dah.register_averaging_hook(DDP(overlap_model), dah.hooks.allreduce_hook, None,
                                             period=2, overlap=True)
    start = lambda i, p: (_base(i, p) + rank) * ws  # exact means in float32
    _set(blocking_model, start)
    _set(overlap_model, start)
    assert blocking.step() and overlapped.step()
    in_flight_before_sync = bool(overlapped.rounds_in_flight)
    overlapped.synchronize()  # no progress between launch and apply
    same_as_blocking = all(torch.equal(a, b) for a, b in
                           zip(blocking_model.parameters(), overlap_model.parameters()))
    # second round: launched, then local progress, then applied
    overlapped.step()  # s=1: nothing to do
    _set(overlap_model, start)
    assert overlapped.step()  # s=2: launched
    launch = [p.detach().clone() for p in overlap_model.parameters()]
    _set(overlap_model, lambda i, p: p + (i + 1) * (rank + 1))  # progress while in flight
    now = [p.detach().clone() for p in overlap_model.parameters()]
    overlapped.step()  # s=3: applies at the latest at the next round; force it here
    overlapped.synchronize()
    state = overlapped.state_dict()  # nothing in flight any more
    return {"in_flight": in_flight_before_sync, "same": same_as_blocking, "launch": launch,
            "now": now, "after": [p.detach().clone() for p in overlap_model.parameters()],
            "anchors": state["anchors"], "rounds": overlapped.stats.rounds}


def test_overlap_equals_blocking_without_progress_and_keeps_progress_exactly():
    ws = 2
    results = run_ranks(_rank_overlap_formula, ws)
    for r, res in enumerate(results):
        assert res["in_flight"] and res["same"] and res["rounds"] == 2
        for i, (launch, now, after) in enumerate(zip(res["launch"], res["now"], res["after"])):
            mean = torch.stack([results[q]["launch"][i] for q in range(ws)]).mean(0)
            assert torch.equal(after, now + (mean - launch)), (r, i)
    assert all(torch.equal(a, b)
               for a, b in zip(results[0]["anchors"][0], results[1]["anchors"][0]))


def _rank_overlap_training(rank, world_size, steps):
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=4,
                                         optimizer=opt, overlap=True, verify=True)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    w = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, -1.0, 2.0]])
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), x @ w.T)
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
    handle.synchronize()
    return {"losses": losses, "rounds": handle.stats.rounds}


def test_overlap_training_converges_and_anchors_agree():
    steps = 60
    for res in run_ranks(_rank_overlap_training, 2, steps=steps):
        assert res["rounds"] == steps // 4
        first, last = sum(res["losses"][:5]) / 5, sum(res["losses"][-5:]) / 5
        assert last < 0.2 * first, (first, last)


def test_mixing_merges_a_late_round_as_a_weighted_sum(world1):
    model = _model()
    handle = dah.register_averaging_hook(DDP(model), dah.hooks.allreduce_hook, None, period=2,
                                         overlap=True, mixing=0.25)
    _set(model, _base)
    launched = [p.detach().clone() for p in model.parameters()]
    assert handle.step()  # launched: the average (one rank) is the parameters now
    _set(model, lambda i, p: p + 4.0)  # progress while the round is in flight
    local = [p.detach().clone() for p in model.parameters()]
    handle.synchronize()
    for p, a, b in zip(model.parameters(), launched, local):
        assert torch.allclose(p.detach(), 0.25 * b + 0.75 * a, atol=1e-6)
    handle.remove()


def test_mixing_needs_overlap_and_a_weight_in_0_1(world1):
    ddp = DDP(_model())
    with pytest.raises(ValueError, match="pass overlap=True"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2, mixing=0.5)
    with pytest.raises(ValueError, match=r"mixing must be in \[0, 1\]"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                    overlap=True, mixing=1.5)


def test_overlap_steps_needs_overlap_a_count_and_a_step_based_period(world1):
    ddp = DDP(_model())
    with pytest.raises(ValueError, match="pass overlap=True"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                    overlap_steps=1)
    with pytest.raises(ValueError, match="overlap_steps must be >= 1, got 0"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                    overlap=True, overlap_steps=0)
    with pytest.raises(TypeError, match="overlap_steps must be an int, got float"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                    overlap=True, overlap_steps=1.0)
    with pytest.raises(ValueError, match="EverySeconds"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, overlap=True,
                                    period=dah.schedules.EverySeconds(1.0), overlap_steps=1)
    with pytest.raises(ValueError, match=r"overlap_steps=3 is more than the period \(2\).*"
                                          r"pass overlap_steps <= 2"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                    overlap=True, overlap_steps=3, fragments=2)
    dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2, overlap=True,
                                overlap_steps=2).remove()


@pytest.mark.parametrize("overlap_steps, landed", [(3, [3, 7]), (4, [4, 8])])
def test_overlap_steps_applies_a_round_that_many_steps_after_its_launch(world1, overlap_steps,
                                                                       landed):
    """The round stays in flight, complete or not, until the step ``overlap_steps`` after
    its launch, and is applied there (at most a period: the next round's launch)."""
    model = _model()
    handle = dah.register_averaging_hook(DDP(model), dah.hooks.allreduce_hook, None, period=4,
                                         overlap=True, overlap_steps=overlap_steps)
    assert handle.step()  # step 0: launched
    landed_at = []
    for step in range(1, 9):
        for rnd in handle.rounds_in_flight:
            rnd.futures[0].wait()  # complete, not yet applied
            assert rnd.done()
        rounds = handle.stats.rounds
        launched = handle.step()
        if handle.stats.rounds != rounds:
            landed_at.append(step)
        assert launched == (step % 4 == 0)
    assert landed_at == landed
    handle.remove()


def _rank_late_rounds(rank, world_size, delay_s, overlap_steps):
    """Train with rounds whose result arrives ``delay_s`` after launch (a slow link);
    the final parameters and the steps at which rounds were applied."""
    from _helpers import flat, late, make_model, train_step

    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    handle = dah.register_averaging_hook(ddp, late(dah.hooks.allreduce_hook, delay_s), None,
                                         period=4, optimizer=opt, overlap=True,
                                         overlap_steps=overlap_steps)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    landed = []
    for step in range(14):
        rounds = handle.stats.rounds
        train_step(ddp, opt, rank, step)
        if handle.stats.rounds != rounds:
            landed.append(step)
    handle.synchronize()
    out = {"params": flat(ddp.module), "landed": landed}
    handle.remove()
    return out


def test_overlap_steps_results_do_not_depend_on_how_long_a_round_takes():
    """Rounds 0.2 s late or at once: with ``overlap_steps=2`` both runs apply every round
    two steps after its launch and end on the same bits."""
    late = run_ranks(_rank_late_rounds, 2, timeout_s=60, delay_s=0.2, overlap_steps=2)
    prompt = run_ranks(_rank_late_rounds, 2, timeout_s=60, delay_s=0.0, overlap_steps=2)
    for a, b in zip(late, prompt):
        assert a["landed"] == b["landed"] == [2, 6, 10]
        assert torch.equal(a["params"], b["params"])
