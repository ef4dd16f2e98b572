"""Round checkpoints on 2 gloo ranks: stop anywhere, resume the newest round every rank
completed, end bit-identical to a run that never stopped."""

from __future__ import annotations

import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.checkpoint import RoundCheckpointer
from _dist import run_ranks
from _helpers import flat, late, make_model, train_step

STEPS, PERIOD, WARMUP = 14, 3, 2  # rounds after steps 2, 5, 8, 11


def _rank_train(rank, world_size, ckpt_dir, stop_at=None, resume=False, wrapped=False,
                overlap=False, every_rounds=1, delay_s=0.0, **options):
    model = make_model()
    ddp = DDP(model)
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    hook = late(dah.hooks.fp16_compress_hook, delay_s) if delay_s else dah.hooks.fp16_compress_hook
    handle = dah.register_averaging_hook(ddp, hook, None, period=PERIOD,
                                         warmup_steps=WARMUP, overlap=overlap,
                                         optimizer=None if wrapped else inner, **options)
    opt = dah.AveragingOptimizer(inner, handle) if wrapped else inner
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    ckpt = RoundCheckpointer(ckpt_dir, handle, model, opt, sched, keep=2,
                             every_rounds=every_rounds)
    restored = ckpt.restore() if resume else None
    restored_at = (handle.step_count, handle.stats.rounds, handle.stats.bytes_sent)
    for step in range(handle.step_count, STEPS):
        if step == stop_at:
            break
        train_step(ddp, opt, rank, step)
        sched.step()
        ckpt.maybe_save()
    handle.synchronize()
    return {"params": flat(model), "rounds": handle.stats.rounds, "bytes": handle.stats.bytes_sent,
            "steps": handle.step_count, "restored": restored, "restored_at": restored_at,
            "lr": opt.param_groups[0]["lr"], "completed": ckpt.completed_rounds()}


@pytest.mark.parametrize("wrapped", [False, True], ids=["optimizer=", "AveragingOptimizer"])
def test_stop_and_resume_is_bit_identical(tmp_path, wrapped):
    straight = run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "a"),
                         wrapped=wrapped)
    first = run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "b"), stop_at=10,
                      wrapped=wrapped)
    assert first[0]["completed"] == [2, 3]  # rounds after steps 5 and 8; keep=2 pruned round 1
    resumed = run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "b"), resume=True,
                        wrapped=wrapped)
    for r in range(2):
        assert resumed[r]["restored"] == 3
        # the counter, the schedule and the stats come back as saved: no phantom step
        assert resumed[r]["restored_at"][:2] == (9, 3)
        assert torch.equal(resumed[r]["params"], straight[r]["params"])
        for key in ("rounds", "bytes", "steps", "lr"):
            assert resumed[r][key] == straight[r][key], key
    # local steps after the last round
    assert not torch.equal(straight[0]["params"], straight[1]["params"])


@pytest.mark.parametrize("how", ["no marker", "another session"])
def test_a_round_one_rank_did_not_finish_saving_is_not_used(tmp_path, how):
    straight = run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "a"))
    run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "b"), stop_at=10)
    newest = tmp_path / "b" / "round-00000003"
    if how == "no marker":  # rank 1 died while saving round 3: its marker never came
        (newest / "rank1.done").unlink()
        (newest / "rank1.pt").write_bytes(b"torn")
    else:  # rank 0's round 3 is from an earlier attempt at it (a crash, then a restart)
        sessions = [json.loads((newest / f"rank{r}.done").read_text())["session"] for r in (0, 1)]
        assert sessions[0] == sessions[1]
        (newest / "rank0.done").write_text("an earlier session")
    (tmp_path / "b" / "round-00000001").mkdir()  # a save of round 1 cut short on rank 1
    (tmp_path / "b" / "round-00000001" / "rank1.pt.tmp").write_bytes(b"torn")
    resumed = run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "b"), resume=True)
    for r in range(2):
        assert resumed[r]["restored"] == 2 and resumed[r]["restored_at"][:2] == (6, 2)
        assert torch.equal(resumed[r]["params"], straight[r]["params"])
    # the resumed run saved round 3 again (both markers of the new session) and pruned
    # the leftovers of rounds older than the newest two it kept
    assert resumed[0]["completed"] == resumed[1]["completed"] == [3, 4]
    kept = sorted(p.name for p in (tmp_path / "b").glob("round-*"))
    assert kept == ["round-00000003", "round-00000004"]


def test_overlapped_rounds_keep_a_model_per_rank(tmp_path):
    straight = run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "a"), overlap=True)
    run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "b"), stop_at=10, overlap=True)
    assert sorted(p.name for p in (tmp_path / "b" / "round-00000003").glob("model*")) == [
        "model_rank0.pt", "model_rank1.pt"]
    resumed = run_ranks(_rank_train, 2, timeout_s=90, ckpt_dir=str(tmp_path / "b"), resume=True,
                        overlap=True)
    for r in range(2):
        assert torch.equal(resumed[r]["params"], straight[r]["params"])


@pytest.mark.parametrize("overlap_steps", [1, 2])
def test_overlapped_rounds_at_a_fixed_step_resume_bit_identical_between_saves(tmp_path,
                                                                              overlap_steps):
    """Saving every other round, the unsaved rounds land ``overlap_steps`` after their
    launch in the run that stopped, in the resumed one and in one that never stopped,
    whose rounds arrive 0.2 s late (at the first step that finds them complete they
    would land at the next round's launch there, the step after their own elsewhere)."""
    kw = dict(timeout_s=90, overlap=True, every_rounds=2, overlap_steps=overlap_steps)
    straight = run_ranks(_rank_train, 2, ckpt_dir=str(tmp_path / "a"), delay_s=0.2, **kw)
    first = run_ranks(_rank_train, 2, ckpt_dir=str(tmp_path / "b"), stop_at=11, **kw)
    assert first[0]["completed"] == [2]  # saved at the round after step 5, not after step 8
    resumed = run_ranks(_rank_train, 2, ckpt_dir=str(tmp_path / "b"), resume=True, **kw)
    for r in range(2):
        assert resumed[r]["restored"] == 2
        assert torch.equal(resumed[r]["params"], straight[r]["params"])


def test_rejects_bad_settings(world1, tmp_path):
    ddp = DDP(make_model())
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="every_rounds must be >= 1"):
        RoundCheckpointer(tmp_path, handle, ddp.module, opt, every_rounds=0)
    with pytest.raises(TypeError, match="keep must be an int"):
        RoundCheckpointer(tmp_path, handle, ddp.module, opt, keep=1.5)
    # parts that could not resume this run: refused before anything is written
    with pytest.raises(TypeError, match=r"handle must be the AveragingHandle.*\(directory, "
                                        r"handle, model, optimizer\)"):
        RoundCheckpointer(tmp_path, ddp.module, handle, opt)
    other = make_model()
    with pytest.raises(ValueError, match="holds none of the parameters the handle averages"):
        RoundCheckpointer(tmp_path, handle, other, opt)
    with pytest.raises(ValueError, match="RoundCheckpointer: the optimizer"):
        RoundCheckpointer(tmp_path, handle, ddp.module, torch.optim.SGD(other.parameters(), lr=1))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        RoundCheckpointer(tmp_path, handle, ddp.module, None)
    assert not any(tmp_path.iterdir())
    RoundCheckpointer(tmp_path, handle, ddp, opt)  # the DDP wrapper holds the same parameters


def test_dcp_state_dict_calls_do_not_count_as_steps(world1):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=4,
                                         optimizer=opt)
    # DCP creates a fresh optimizer's state with a step at lr 0 on zero gradients
    model_sd, optim_sd = get_state_dict(ddp, opt)
    set_state_dict(ddp, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert (handle.step_count, handle.stats.rounds) == (0, 0)
    # a real first step at lr 0 (a warm-up from zero) still counts
    fresh = torch.optim.SGD(ddp.parameters(), lr=0.0)
    other = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, optimizer=fresh)
    train_step(ddp, fresh, 0, 0)
    assert other.step_count == 1


def test_an_averaging_optimizer_saves_the_handle_state_once(tmp_path, world1):
    model = make_model()
    ddp = DDP(model)
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
    opt = dah.AveragingOptimizer(inner, handle)
    ckpt = RoundCheckpointer(tmp_path, handle, model, opt)
    for step in range(2):
        train_step(ddp, opt, 0, step)
        ckpt.maybe_save()
    saved = [torch.load(f, weights_only=True) for f in sorted(tmp_path.glob("*/rank0.pt"))]
    assert saved, "no round was saved"
    for state in saved:
        assert set(state["optimizer"]) == {"state", "param_groups"}  # the inner optimizer's
        assert 1 <= state["averaging"]["step_count"] <= handle.step_count  # saved once, here
    handle.remove()
