"""Checkpoints that are safe to load and never lost, on 2 and 3 gloo ranks: a tampered
pickle is refused unrun, a damaged newest round falls back to the older one (bit-identical
to a run that used it), another world size or model is refused on every rank before
anything is loaded, and the old rounds' files are unchanged afterwards."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.checkpoint import RoundCheckpointer
from _dist import run_ranks
from _helpers import flat, make_model, train_step

STEPS, PERIOD, WARMUP = 14, 3, 2  # rounds after steps 2, 5, 8, 11


def _rank(rank, world_size, ckpt_dir, stop_at=None, resume=False, dims=(5, 8, 3),
          groups=1, scheduler=False, adam=False):
    model = make_model(dims=dims)
    ddp = DDP(model)
    params = list(ddp.parameters())
    grouped = [{"params": params[k::groups]} for k in range(groups)]
    opt = (torch.optim.Adam(grouped, lr=0.05) if adam
           else torch.optim.SGD(grouped, lr=0.05, momentum=0.9))
    handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook, None, period=PERIOD,
                                         warmup_steps=WARMUP, optimizer=opt)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5) if scheduler else None
    ckpt = RoundCheckpointer(ckpt_dir, handle, model, opt, sched, keep=2)
    out = {"error": None, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["restored"] = ckpt.restore() if resume else None
            for step in range(handle.step_count, STEPS):
                if step == stop_at:
                    break
                train_step(ddp, opt, rank, step, dims=dims)
                ckpt.maybe_save()
        except dah.errors.CheckpointError as exc:
            out["error"] = str(exc)
    out["warnings"] = [str(w.message) for w in caught if "RoundCheckpointer" in str(w.message)]
    out["params"] = flat(model)
    out["step_count"] = handle.step_count
    handle.remove()
    return out


def _digests(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path_factory.mktemp("a")))


def _stopped(tmp_path, world=2):
    run_ranks(_rank, world, timeout_s=90, ckpt_dir=str(tmp_path), stop_at=10)
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-00000002", "round-00000003"]


@pytest.mark.parametrize("damaged", ["rank1.pt", "model.pt", "rank1.done"])
def test_a_truncated_newest_round_falls_back_to_the_older_one(tmp_path, straight, damaged):
    _stopped(tmp_path)
    path = tmp_path / "round-00000003" / damaged
    path.write_bytes(path.read_bytes()[:100])
    resumed = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path), resume=True)
    for r in range(2):
        assert resumed[r]["error"] is None and resumed[r]["restored"] == 2
        assert any(str(path) in w and "damaged" in w for w in resumed[r]["warnings"])
        # the same run as one that resumed round 2 on purpose: the uninterrupted one
        assert torch.equal(resumed[r]["params"], straight[r]["params"])


def test_a_rank_file_of_an_older_round_in_a_newer_folder_is_not_mixed_in(tmp_path, straight):
    # rank 1's files of round 2, with their marker, put in round 3's folder: the checksums
    # agree, but the ranks would resume different rounds
    _stopped(tmp_path)
    for name in ("rank1.pt", "rank1.done"):
        (tmp_path / "round-00000003" / name).write_bytes(
            (tmp_path / "round-00000002" / name).read_bytes())
    resumed = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path), resume=True)
    for r in range(2):
        assert resumed[r]["error"] is None and resumed[r]["restored"] == 2
        assert any("holds round 2, not round 3" in w for w in resumed[r]["warnings"])
        assert torch.equal(resumed[r]["params"], straight[r]["params"])


class _Payload:
    """Unpickling this runs code: it would create the file ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _vouch_for(target):
    """Rewrite the marker beside ``target`` (``rank{r}.pt``) to hold its checksum, as
    someone who replaced the file and knows the format would."""
    done = target.with_suffix(".done")
    m = json.loads(done.read_text())
    m["files"][target.name] = hashlib.sha256(target.read_bytes()).hexdigest()
    done.write_text(json.dumps(m))


@pytest.mark.parametrize("marker", ["as left", "rewritten to match"])
def test_a_tampered_pickle_is_never_run(tmp_path, marker):
    ckpt = tmp_path / "ckpt"
    _stopped(ckpt)
    sentinel = tmp_path / "pwned"
    for rounds in ("round-00000002", "round-00000003"):
        target = ckpt / rounds / "rank0.pt"
        target.write_bytes(pickle.dumps({"optimizer": _Payload(str(sentinel))}))
        if marker == "rewritten to match":  # the attacker fixed the checksum too
            _vouch_for(target)
    before = _digests(ckpt)
    resumed = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(ckpt), resume=True)
    assert not sentinel.exists()
    for r in range(2):  # refused on every rank, naming what is wrong
        error = resumed[r]["error"]
        assert error is not None
        assert "rank0.pt" in error and "rank 0:" in error, error
    assert _digests(ckpt) == before  # nothing overwritten, nothing pruned


def test_a_rewritten_file_of_plain_containers_is_refused_on_every_rank(tmp_path):
    """Tensors and containers that weights_only loads, with the marker's checksum fixed,
    but not a round's state: every rank hears of it (none waits on another that failed)."""
    _stopped(tmp_path)
    for rounds in ("round-00000002", "round-00000003"):
        target = tmp_path / rounds / "rank1.pt"
        torch.save({"format": 1, "own_model": False, "optimizer": {"param_groups": [1]}},
                   target)
        _vouch_for(target)
    before = _digests(tmp_path)
    resumed = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path), resume=True)
    for r in range(2):
        assert "rank 1:" in resumed[r]["error"]
        assert "rank1.pt is not a round checkpoint of this format" in resumed[r]["error"]
    assert _digests(tmp_path) == before


@pytest.mark.parametrize("saved_by, restored_by", [(2, 3), (2, 1), (3, 2)])
def test_another_world_size_is_refused_and_the_rounds_stay(tmp_path, saved_by, restored_by):
    _stopped(tmp_path, saved_by)
    before = _digests(tmp_path)
    resumed = run_ranks(_rank, restored_by, timeout_s=90, ckpt_dir=str(tmp_path), resume=True)
    for r in range(restored_by):
        expected = f"saved by {saved_by} processes and this run has {restored_by}"
        assert expected in resumed[r]["error"]
    assert _digests(tmp_path) == before


def test_another_model_is_refused_naming_the_checkpoint_and_the_parameter(tmp_path):
    _stopped(tmp_path)
    before = _digests(tmp_path)
    resumed = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path), resume=True,
                        dims=(5, 6, 3))
    for r in range(2):
        error = resumed[r]["error"]
        assert "round-00000003" in error and "model.pt is of another model" in error, error
        assert "'0.weight'" in error
    assert _digests(tmp_path) == before


@pytest.mark.parametrize("damaged", ["rank1.pt", "rank1.done"])
def test_every_round_damaged_is_an_error_not_a_fresh_start(tmp_path, damaged):
    _stopped(tmp_path)
    for rounds in ("round-00000002", "round-00000003"):
        (tmp_path / rounds / damaged).write_bytes(b"garbage{")
    before = _digests(tmp_path)
    resumed = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path), resume=True)
    for r in range(2):
        assert "no round every rank completed can be verified and read" in resumed[r]["error"]
        assert "refusing to start over" in resumed[r]["error"]
        assert str(tmp_path / "round-00000002" / damaged) in resumed[r]["error"]
        assert len(resumed[r]["warnings"]) == 2  # each round named as it was skipped
    assert _digests(tmp_path) == before
    # and a run that does not restore() does not save over them either
    fresh = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path))
    for r in range(2):
        assert "holds round 3 of another run; call restore() first" in fresh[r]["error"]
    assert _digests(tmp_path) == before


@pytest.mark.parametrize("change, expected", [
    ({"groups": 2}, "its optimizer has 1 parameter group(s), this run's 2"),
    ({"scheduler": True}, "was saved without an LR scheduler and this run passes one"),
    ({"adam": True}, "was saved with a torch.optim.sgd.SGD and this run's optimizer is a "
                     "torch.optim.adam.Adam"),
])
def test_another_optimizer_or_scheduler_is_refused_before_anything_loads(tmp_path, change,
                                                                          expected):
    _stopped(tmp_path)
    before = _digests(tmp_path)
    resumed = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path), resume=True, **change)
    for r in range(2):
        assert expected in resumed[r]["error"] and "round 3 does not fit" in resumed[r]["error"]
        assert resumed[r]["step_count"] == 0  # the handle was not loaded
    assert _digests(tmp_path) == before


def test_a_new_run_does_not_save_over_another_runs_rounds(tmp_path):
    _stopped(tmp_path)
    before = _digests(tmp_path)
    fresh = run_ranks(_rank, 2, timeout_s=90, ckpt_dir=str(tmp_path))  # no restore()
    for r in range(2):
        assert "holds round 3 of another run; call restore() first" in fresh[r]["error"]
    assert _digests(tmp_path) == before


def test_what_the_library_writes_loads_with_weights_only(tmp_path):
    _stopped(tmp_path)
    for path in sorted(tmp_path.rglob("*.pt")):
        torch.load(path, weights_only=True)  # plain tensors and containers only
    marker = json.loads((tmp_path / "round-00000003" / "rank1.done").read_text())
    assert marker["world_size"] == 2 and set(marker["files"]) == {"rank1.pt"}
    assert os.path.exists(tmp_path / "round-00000003" / "model.pt")


def _exact_every_two_steps():
    """A DDP model, SGD and exact rounds every 2 steps: ``(model, ddp, opt, handle)``."""
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         optimizer=opt)
    return model, ddp, opt, handle


def test_a_save_that_fails_changes_no_round_on_disk(tmp_path, world1):
    # the end of a training loop in the wrong order: remove() before the last save()
    model, ddp, opt, handle = _exact_every_two_steps()
    ckpt = RoundCheckpointer(tmp_path, handle, model, opt, keep=2)
    for step in range(6):
        train_step(ddp, opt, 0, step)
        ckpt.maybe_save()
    assert ckpt.completed_rounds() == [2, 3]
    before = _digests(tmp_path)
    handle.remove()
    with pytest.raises(RuntimeError, match="after remove"):
        ckpt.save()
    assert ckpt.completed_rounds() == [2, 3] and _digests(tmp_path) == before


def test_a_scheduler_that_is_not_one_is_refused_at_construction(tmp_path, world1):
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, optimizer=opt)
    with pytest.raises(TypeError, match="scheduler must be an LR scheduler.*got str"):
        RoundCheckpointer(tmp_path, handle, ddp.module, opt, "cosine")
    with pytest.raises(TypeError, match="directory must be a path.*got NoneType"):
        RoundCheckpointer(None, handle, ddp.module, opt)
    assert not any(tmp_path.iterdir())
    handle.remove()


def _rank_disk_fails(rank, world_size, ckpt_dir):
    # rank 1's disk is full for one save's files, then a directory stands where one
    # save's marker goes: every rank raises, the rounds saved before stay, and training
    # and saving go on once the fault is gone
    import errno
    from pathlib import Path

    import ddp_avg_hooks.checkpoint as checkpoint

    model, ddp, opt, handle = _exact_every_two_steps()
    ckpt = RoundCheckpointer(ckpt_dir, handle, model, opt, keep=2)
    write_aside = checkpoint._write_aside

    def disk_full(obj, tmp):
        write_aside(obj, tmp)  # part of it reached the disk
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    out, step = {"errors": [], "digests": []}, 0
    for fault in (None, "disk full", "rank1.done", None):
        for _ in range(2):  # one round
            train_step(ddp, opt, rank, step)
            step += 1
        blocked = Path(ckpt_dir) / f"round-{handle.stats.rounds:08d}" / str(fault)
        if rank == 1 and fault == "disk full":
            checkpoint._write_aside = disk_full
        elif rank == 1 and fault:
            blocked.mkdir(parents=True)
        torch.distributed.barrier()
        before = _digests(Path(ckpt_dir)) if fault else None
        torch.distributed.barrier()  # neither rank writes before both have looked
        try:
            ckpt.save()
            out["errors"].append(None)
        except dah.errors.CheckpointError as exc:
            out["errors"].append(str(exc))
        out["completed"] = ckpt.completed_rounds()
        torch.distributed.barrier()  # both ranks have cleaned up
        if fault:
            after = _digests(Path(ckpt_dir))
            out["digests"].append(after == before if fault == "disk full" else
                                  {k: v for k, v in after.items() if k in before} == before)
            checkpoint._write_aside = write_aside
            if rank == 1 and fault != "disk full":
                blocked.rmdir()
        torch.distributed.barrier()
    out["restored"] = ckpt.restore()
    handle.remove()
    return out


def test_one_ranks_failed_save_raises_on_every_rank_and_keeps_the_rounds(tmp_path):
    # before the fix the other rank waited in the next collective for the failed one
    outs = run_ranks(_rank_disk_fails, 2, timeout_s=90, pg_timeout_s=20, ckpt_dir=str(tmp_path))
    for out in outs:
        first, files, marker, last = out["errors"]
        assert files and "saving round 2" in files and "rank 1: OSError" in files
        assert "No space left" in files
        assert marker and "marking round 3" in marker and "rank 1: IsADirectoryError" in marker
        assert "kept" in files and "kept" in marker and "rank 0" not in files + marker
        assert first is None and last is None and out["digests"] == [True, True]
        assert out["completed"] == [1, 4] and out["restored"] == 4
    assert sorted(p.name for p in tmp_path.glob("round-*")) == ["round-00000001", "round-00000004"]


def _signal(folder, name) -> None:
    with open(os.path.join(folder, name), "w"):
        pass


def _wait_for(folder, name, timeout_s=60.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {name} after {timeout_s} s")
        time.sleep(0.05)


def _rank_one_of_two_jobs(rank, world_size, ckpt_dir, signals, job):
    # two jobs of 2 ranks each, started by mistake on one folder, in turns: the first
    # saves rounds 1 and 2; the second resumes round 2 (and so becomes the folder's
    # writer); the first's next save is refused on both its ranks; the second saves on
    model, ddp, opt, handle = _exact_every_two_steps()
    ckpt = RoundCheckpointer(ckpt_dir, handle, model, opt, keep=2)
    out = {"errors": []}

    def one_round(step):
        for s in (step, step + 1):
            train_step(ddp, opt, rank, s)
        try:
            ckpt.save()
            out["errors"].append(None)
        except dah.errors.CheckpointError as exc:
            out["errors"].append(str(exc))

    def then(name):  # rank 0 tells the other job, once both ranks are there
        torch.distributed.barrier()
        if rank == 0:
            _signal(signals, name)

    if job == "first":
        ckpt.restore()
        one_round(0), one_round(2)
        then("first saved")
        _wait_for(signals, "second restored")
        one_round(4)
        then("first done")
    else:
        _wait_for(signals, "first saved")
        out["restored"] = ckpt.restore()
        then("second restored")
        _wait_for(signals, "first done")
        one_round(4), one_round(6)
        out["completed"] = ckpt.completed_rounds()
    out["params"] = flat(model)
    handle.remove()
    return out


def test_a_second_job_on_the_same_folder_stops_the_first_from_saving(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    folder, signals = tmp_path / "ckpt", tmp_path / "signals"
    signals.mkdir()
    with ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(run_ranks, _rank_one_of_two_jobs, 2, timeout_s=120, pg_timeout_s=20,
                            ckpt_dir=str(folder), signals=str(signals), job=job)
                for job in ("first", "second")]
        first, second = (job.result() for job in jobs)
    for out in first:
        assert out["errors"][:2] == [None, None]
        refused = out["errors"][2]
        assert refused and "another run" in refused and "its own folder" in refused, refused
    for out in second:
        assert out["restored"] == 2 and out["errors"] == [None, None]
        assert out["completed"] == [3, 4]
    assert torch.equal(second[0]["params"], second[1]["params"])
    assert sorted(p.name for p in folder.glob("round-*")) == ["round-00000003", "round-00000004"]
