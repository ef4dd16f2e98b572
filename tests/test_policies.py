"""Buffers, optimizer state, period schedules and telemetry, each against an
independent reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.schedules import AdaCommPeriod, PostLocalPeriod, StepwisePeriod
from _dist import run_ranks


def _batch(rank, step, n=8):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


# --- buffers ---------------------------------------------------------------------------
def _rank_buffers(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    ddp = DDP(model, broadcast_buffers=False)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         average_buffers=True)
    x, _ = _batch(rank, 0)
    ddp(x * (rank + 1))  # rank-dependent running statistics
    bn = model[1]
    before = {"mean": bn.running_mean.clone(), "var": bn.running_var.clone(),
              "tracked": bn.num_batches_tracked.clone()}
    handle.step()
    after = {"mean": bn.running_mean.clone(), "var": bn.running_var.clone(),
             "tracked": bn.num_batches_tracked.clone()}
    return {"before": before, "after": after, "bytes": handle.stats.last_round_bytes,
            "params": sum(p.numel() for p in model.parameters())}


def test_floating_buffers_are_averaged_integer_buffers_left_alone():
    results = run_ranks(_rank_buffers, 2)
    for key in ("mean", "var"):
        mean = torch.stack([r["before"][key] for r in results]).mean(0)
        for r in results:
            torch.testing.assert_close(r["after"][key], mean, rtol=1e-6, atol=0)
    for r in results:
        assert torch.equal(r["after"]["tracked"], r["before"]["tracked"])
        assert r["bytes"] == (r["params"] + 6) * 4  # parameters + running mean and var


def test_average_buffers_warns_when_ddp_broadcasts_them():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DDP(torch.nn.BatchNorm1d(3))
        with pytest.warns(UserWarning, match="broadcast_buffers=False"):
            dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, average_buffers=True)
        with pytest.raises(ValueError, match="needs the optimizer"):
            dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                        optimizer_state="average")
        with pytest.raises(ValueError, match="optimizer_state must be one of"):
            dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                        optimizer=torch.optim.SGD(ddp.parameters(), lr=1),
                                        optimizer_state="mean")
    finally:
        dist.destroy_process_group()


# --- optimizer state ---------------------------------------------------------------------
def _rank_optimizer_state(rank, world_size, policy, optim):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = DDP(model)
    opt = (torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9) if optim == "sgd"
           else torch.optim.Adam(ddp.parameters(), lr=0.01))
    snapshots = []

    def snapshot(o, args, kwargs):  # registered first: runs before the averaging round
        snapshots.append({k: v.clone() for p in model.parameters() for k, v in o.state[p].items()
                          if k != "step" for k in [f"{k}{tuple(p.shape)}"]})

    opt.register_step_post_hook(snapshot)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         warmup_steps=1, optimizer=opt, optimizer_state=policy)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    steps = []
    for step in range(4):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        steps.append({f"{k}{tuple(p.shape)}": v.clone() for p in model.parameters()
                      for k, v in opt.state[p].items() if k != "step"})
    return {"before": snapshots, "after": steps}


@pytest.mark.parametrize("policy, optim", [("average", "sgd"), ("average", "adam")])
def test_optimizer_state_policies(policy, optim):
    results = run_ranks(_rank_optimizer_state, 2, policy=policy, optim=optim)
    for step in range(4):
        rounded = step in (1, 3)
        for key, value in results[0]["after"][step].items():
            befores = [r["before"][step][key] for r in results]
            for r in results:
                got = r["after"][step][key]
                if not rounded:
                    assert torch.equal(got, r["before"][step][key])
                else:
                    torch.testing.assert_close(got, torch.stack(befores).mean(0), rtol=1e-6, atol=0)


_FRESH = {"adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
          "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
          "rprop": lambda ps: torch.optim.Rprop(ps, lr=0.01)}


def _rank_reset(rank, world_size, optim):
    """Each step after a round against a new optimizer of the same settings, made then
    over a copy of the parameters the round left, stepping on the same batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = DDP(model)
    opt = _FRESH[optim](ddp.parameters())
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         warmup_steps=1, optimizer=opt, optimizer_state="reset")
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    reference, compared = None, []
    for step in range(6):
        x, y = _batch(rank, step)
        if reference is not None:
            ref_model, ref_opt = reference
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(ref_model(x), y).backward()
            ref_opt.step()
        rounds = handle.stats.rounds
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if reference is not None:
            pairs = zip(model.parameters(), reference[0].parameters())
            compared.append((step, [(p - q).abs().max().item() for p, q in pairs]))
        reference = None
        if handle.stats.rounds > rounds:
            assert all(not opt.state[p] for p in model.parameters())
            ref_model = torch.nn.Linear(4, 2)
            ref_model.load_state_dict(model.state_dict())
            reference = (ref_model, _FRESH[optim](ref_model.parameters()))
    return compared


@pytest.mark.parametrize("optim", sorted(_FRESH))
def test_reset_makes_the_next_step_a_new_optimizers_first_step(optim):
    # Adam: the bias correction of step 1 (zeroed moments at a late step count give up to
    # sqrt(1 / (1 - beta2)) / 10 = 3.2x its step); SGD with dampening: the momentum from
    # that step's gradient alone; Rprop: step sizes back at lr (zeroed, it never moves again)
    for compared in run_ranks(_rank_reset, 2, optim=optim):
        assert [step for step, _ in compared] == [2, 4]
        for step, gaps in compared:
            assert max(gaps) == 0.0, (optim, step, gaps)


def _state_of(model, opt):
    state = {f"{k}{tuple(p.shape)}": v.clone() for p in model.parameters()
             for k, v in opt.state[p].items() if k != "step"}
    bn = model[1]
    state.update(running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone())
    return state


def _rank_overlapped_state(rank, world_size, mixing):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2))
    ddp = DDP(model, broadcast_buffers=False)
    # beta2 = 0.3: the second moment forgets fast, so that rank 0's, far above the average
    # at launch, would be corrected below zero when the round is applied a step later
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01, betas=(0.9, 0.3))
    seen = []
    opt.register_step_post_hook(lambda o, a, k: seen.append(_state_of(model, opt)))
    handle = dah.register_averaging_hook(
        ddp, dah.hooks.allreduce_hook, None, period=4, overlap=True, optimizer=opt,
        optimizer_state="average", average_buffers=True, mixing=mixing)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    for step in range(2):  # the round launched after step 0 is applied by step 1's end
        x, y = _batch(rank, step)
        scale = (10.0 if rank == 0 else 0.1) if step == 0 else 0.01
        opt.zero_grad()
        (scale * torch.nn.functional.mse_loss(ddp(x), y)).backward()
        opt.step()  # our hook first (it saw the state), then the handle's step
    handle.synchronize()
    return {"launch": seen[0], "before": seen[1], "after": _state_of(model, opt),
            "rounds": handle.stats.rounds}


@pytest.mark.parametrize("mixing", [None, 0.25])
def test_an_overlapped_round_keeps_the_local_progress_of_buffers_and_optimizer_state(mixing):
    results = run_ranks(_rank_overlapped_state, 2, mixing=mixing)
    clamped = 0
    for r in results:
        assert r["rounds"] == 1
        for key, launch in r["launch"].items():
            mean = torch.stack([q["launch"][key] for q in results]).mean(0)
            if mixing is not None:  # the parameters' rule with mixing: a blend
                want = mixing * r["before"][key] + (1 - mixing) * mean
                torch.testing.assert_close(r["after"][key], want, rtol=1e-6, atol=1e-7)
                continue
            want = r["before"][key] + (mean - launch)  # the parameters' rule
            if bool((launch >= 0).all()):  # Adam's second moment, the running variance
                floor = torch.minimum(r["before"][key], mean)
                clamped += int((want < 0).sum())
                want = torch.maximum(want, floor)
            torch.testing.assert_close(r["after"][key], want, rtol=1e-6, atol=1e-7)
    assert clamped or mixing is not None  # the case the floor exists for did occur


# --- schedules ---------------------------------------------------------------------------
def _rank_schedules(rank, world_size):
    out = {}
    cases = {
        "post_local": (PostLocalPeriod(period=2, switch_step=6, period_after=4), 1),
        "stepwise": (StepwisePeriod(2, {6: 3}), 0),
        "adacomm": (AdaCommPeriod(initial=8, min_period=2), 0),
    }
    for name, (schedule, warmup) in cases.items():
        ddp = DDP(torch.nn.Linear(2, 2))
        handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                             period=schedule, warmup_steps=warmup)
        rounds = []
        for step in range(21):
            if name == "adacomm":  # each rank sees its own loss; the decision is shared
                schedule.observe((1 + rank) * (1.0 if step == 0 else 0.25))
            if handle.step():
                rounds.append(step)
        out[name] = {"rounds": rounds, "period": handle.period}
        handle.remove()
    return out


def test_each_schedule_averages_on_exactly_its_steps_on_every_rank():
    expected = {
        "post_local": [1, 3, 5, 7, 11, 15, 19],  # period 2 before step 6, 4 after
        "stepwise": [0, 2, 4, 6, 9, 12, 15, 18],  # period 3 from step 6
        # mean loss falls to a quarter of the first: period 8 * sqrt(1/4) = 4
        "adacomm": [0, 8, 12, 16, 20],
    }
    for res in run_ranks(_rank_schedules, 2):
        for name, rounds in expected.items():
            assert res[name]["rounds"] == rounds, name
        assert res["adacomm"]["period"] == 4


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="period_after must be >= 1"):
        PostLocalPeriod(2, 10, 0)
    with pytest.raises(TypeError, match="milestones must map"):
        StepwisePeriod(2, [10, 20])
    with pytest.raises(ValueError, match="min_period"):
        AdaCommPeriod(initial=2, min_period=4)


# --- telemetry -------------------------------------------------------------------------
def _rank_telemetry(rank, world_size):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ddp = DDP(model)
    calls = []
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=1,
                                         track_consensus=True,
                                         on_round=lambda h: calls.append(h.stats.rounds))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(rank)))
    before = [p.detach().clone() for p in model.parameters()]
    handle.step()
    s = handle.stats
    return {"before": before, "distance": s.consensus_distance, "calls": calls,
            "wait": s.wait_seconds, "seconds": s.seconds, "last": s.last_round_bytes,
            "per_round": s.bytes_per_round}


def test_consensus_distance_equals_a_direct_computation():
    ws = 3
    results = run_ranks(_rank_telemetry, ws)
    flat = [torch.cat([p.reshape(-1) for p in r["before"]]).double() for r in results]
    mean = torch.stack(flat).mean(0)
    direct = sum(float((f - mean).pow(2).sum()) for f in flat) / ws
    for r in results:
        assert r["distance"] == pytest.approx(direct, rel=1e-5)
        assert r["calls"] == [1]
        assert 0 < r["wait"] <= r["seconds"]
        assert r["last"] == r["per_round"] == 15 * 4


def test_profiler_ranges_name_the_phases():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        handle = dah.register_averaging_hook(DDP(torch.nn.Linear(2, 2)),
                                             dah.hooks.allreduce_hook, None)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            handle.average()
        names = {e.name for e in prof.events()}
        for phase in ("launch", "wait", "write_back"):
            assert f"ddp_avg_hooks::round::{phase}" in names
    finally:
        dist.destroy_process_group()
