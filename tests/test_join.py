"""Uneven inputs: ``Join([ddp, handle])`` lets ranks with fewer batches finish while the
others train on, with every round still complete, against a single-process replay."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks

WARMUP, PERIOD, LR = 2, 3, 0.1


def _rank_uneven(rank, world_size, batches, hook="allreduce", options=None,
                 joinables="ddp,handle", ddp_options=None):
    """Train ``batches[rank]`` steps inside Join; what each rank ends with."""
    from _helpers import flat, make_model, train_step

    ddp = DDP(make_model(), **(ddp_options or {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    hooks = {"allreduce": (dah.hooks.allreduce_hook, None),
             "int8": (dah.hooks.int8_compress_hook, dah.hooks.QuantizedDeltaState())}
    handle = dah.register_averaging_hook(ddp, *hooks[hook], warmup_steps=WARMUP,
                                         optimizer=opt, **{"period": PERIOD, **(options or {})})
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    order = {"ddp": ddp, "handle": handle}
    try:
        with Join([order[name] for name in joinables.split(",")]):
            for step in range(batches[rank]):
                train_step(ddp, opt, rank, step)
    except RuntimeError as exc:
        return {"error": str(exc)}
    out = {"params": flat(ddp.module), "steps": handle.step_count,
           "rounds": handle.stats.rounds}
    handle.remove()
    return out


def _replay(batches):
    """Two replicas in one process: DDP's averaged gradients during the warm-up, local
    SGD steps after it, and at each round the average of both replicas' parameters,
    a replica whose batches ran out entering with its parameters as they are. Rank 0
    has the most batches: DDP's Join ends with its model on every rank."""
    from _helpers import loss_of, make_model

    models = [make_model(), make_model()]
    opts = [torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9) for m in models]
    rounds = 0
    for step in range(max(batches)):
        active = [r for r in range(2) if step < batches[r]]
        grads = {}
        for r in active:
            opts[r].zero_grad()
            loss_of(models[r], r, step).backward()
            grads[r] = [p.grad.clone() for p in models[r].parameters()]
        if step < WARMUP:  # DDP: the mean over both ranks, a joined one sending zeros
            mean = [sum(g[i] for g in grads.values()) / 2 for i in range(len(grads[0]))]
            for r in active:
                for p, g in zip(models[r].parameters(), mean):
                    p.grad = g.clone()
        for r in active:
            opts[r].step()
        if step >= WARMUP and (step - WARMUP) % PERIOD == 0:
            rounds += 1
            with torch.no_grad():
                for a, b in zip(*(m.parameters() for m in models)):
                    a.copy_((a + b) / 2)
                    b.copy_(a)
    return torch.cat([p.detach().reshape(-1) for p in models[0].parameters()]), rounds


@pytest.mark.parametrize("batches, ddp_options", [
    ((11, 7), {}), ((9, 0), {}), ((11, 7), {"find_unused_parameters": True}),
], ids=["after_warmup", "no_batches", "reducer_kept_on"])
def test_uneven_inputs_finish_with_the_replayed_model(batches, ddp_options):
    """Rank 1 runs out of batches (after the warm-up, or before the first); rank 0
    trains on, its rounds still averaging with rank 1's parameters: both end with the
    model of the single-process replay, and the same step and round counts. With DDP's
    reducer kept on after the warm-up, the comm hook runs on both sides alike."""
    expected, rounds = _replay(batches)
    results = run_ranks(_rank_uneven, 2, timeout_s=90, pg_timeout_s=60, batches=batches,
                        ddp_options=ddp_options)
    for res in results:
        assert "error" not in res, res
        assert res["steps"] == batches[0] and res["rounds"] == rounds
        torch.testing.assert_close(res["params"], expected, rtol=0, atol=1e-6)


def test_uneven_inputs_with_overlapped_compressed_rounds_end_equal():
    """int8 rounds of 2 fragments in flight when the ranks join: no hang, and the
    replicas end equal (the rounds in flight applied, then one exact average)."""
    options = {"overlap": True, "overlap_steps": 1, "fragments": 3}
    results = run_ranks(_rank_uneven, 2, timeout_s=90, pg_timeout_s=60, batches=(12, 5),
                        hook="int8", options=options)
    assert all("error" not in r for r in results), results
    assert results[0]["steps"] == results[1]["steps"] == 12
    assert results[0]["rounds"] == results[1]["rounds"] > 0
    torch.testing.assert_close(results[0]["params"], results[1]["params"], rtol=0, atol=0)


def test_join_refuses_the_handle_before_the_ddp_model():
    results = run_ranks(_rank_uneven, 2, timeout_s=90, pg_timeout_s=60, batches=(4, 4),
                        joinables="handle,ddp")
    for res in results:
        assert "pass the DDP model to Join first" in res["error"]


def _rank_two_forwards(rank, world_size):
    from _helpers import loss_of, make_model

    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         optimizer=opt)
    def accumulated_step():
        opt.zero_grad()
        (loss_of(ddp, rank, 0) + loss_of(ddp, rank, 1)).backward()
        opt.step()

    with Join([ddp, handle]):  # even inputs, one forward a step
        loss_of(ddp, rank, 2).backward()
        opt.step()
    accumulated_step()  # after the block: allowed again
    try:
        with Join([ddp, handle]):
            accumulated_step()
    except RuntimeError as exc:
        return handle.step_count, str(exc)
    return handle.step_count, None


def test_join_refuses_two_forwards_a_step_inside_and_not_after():
    for steps, message in run_ranks(_rank_two_forwards, 2, timeout_s=90, pg_timeout_s=60):
        assert steps == 2
        assert message is not None and "after 2 forwards of the DDP model" in message


def test_join_refuses_time_based_rounds_and_another_group(world1):
    import torch.distributed as dist
    from _helpers import make_model

    ddp = DDP(make_model())
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=dah.schedules.EverySeconds(1.0))
    with pytest.raises(ValueError, match="time-based rounds.*rounds_started < rounds"):
        Join([ddp, handle])
    handle.remove()
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, dist.new_group([0]))
    with pytest.raises(ValueError, match="another process group than DDP's"):
        Join([ddp, handle])
    handle.remove()


def _rank_uneven_checkpoints(rank, world_size, directory, batches, with_checkpointer):
    from _helpers import flat, make_model, train_step

    from ddp_avg_hooks.checkpoint import RoundCheckpointer

    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=PERIOD,
                                         warmup_steps=WARMUP, optimizer=opt)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    ckpt = RoundCheckpointer(directory, handle, ddp.module, opt, keep=10)
    ckpt.restore()
    joinables = [ddp, handle, ckpt] if with_checkpointer else [ddp, handle]
    try:
        with Join(joinables):
            for step in range(batches[rank]):
                train_step(ddp, opt, rank, step)
                ckpt.maybe_save()
    except RuntimeError as exc:
        return {"error": str(exc)}
    ckpt.maybe_save()  # outside the block: as before
    out = {"completed": ckpt.completed_rounds(), "rounds": handle.stats.rounds,
           "params": flat(ddp.module)}
    handle.remove()
    return out


def test_a_checkpointer_in_join_saves_every_round_on_every_rank(tmp_path):
    """Rank 1 runs out after 6 of rank 0's 14 steps; passed to Join, the checkpointer saves
    each round on both ranks (the finished one included), and nothing hangs."""
    out = run_ranks(_rank_uneven_checkpoints, 2, timeout_s=90, pg_timeout_s=60,
                    directory=str(tmp_path), batches=(14, 6), with_checkpointer=True)
    rounds = len(range(WARMUP, 14, PERIOD))
    for res in out:
        assert "error" not in res, res
        assert res["rounds"] == rounds and res["completed"] == list(range(1, rounds + 1))
    torch.testing.assert_close(out[0]["params"], out[1]["params"], rtol=0, atol=0)


def test_a_checkpointer_left_out_of_join_is_refused_on_every_rank(tmp_path):
    out = run_ranks(_rank_uneven_checkpoints, 2, timeout_s=90, pg_timeout_s=60,
                    directory=str(tmp_path), batches=(14, 6), with_checkpointer=False)
    for res in out:
        assert "pass both the handle and the checkpointer" in res["error"]
