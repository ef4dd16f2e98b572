"""What a training run records, alike for ``train.py``'s loop and ``timed_loop.py``'s.

The wire counter, the wait for the other ranks as a validation begins (added to the step
before), every rank's figures, the handles' statistics, the summary block, and ``metrics.json``.
"""
from __future__ import annotations

import json
import os
import resource
import statistics
import sysconfig

import torch
import torch.distributed as dist


def read_wire(iface: str | None) -> int | None:
    """The kernel's transmit counter of network device ``iface`` (``None``: none, or unread)."""
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def wait_before_validation(steps: list[dict], wait_for_ranks, all_reduce) -> float:
    """Wait for the other ranks; the seconds waited are part of the last step's record.

    Returns those seconds (they count on the training clock), so that the records still
    add up to it.
    """
    waited = wait_for_ranks(all_reduce)
    if steps:
        steps[-1]["step_s"] = round(steps[-1]["step_s"] + waited, 6)
        steps[-1]["comm_s"] = round(steps[-1]["comm_s"] + waited, 6)
    return waited


def gather_per_rank(steps: list[dict], train_s: float, total_bytes: int, sleep_s: float,
                    world: int) -> dict:
    """Every rank's training time, bytes, comm wait, steps, sleep and peak resident memory
    (the process's, so far): a collective."""
    comm_s = sum(r["comm_s"] for r in steps)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # KiB on Linux
    mine = torch.tensor([train_s, float(total_bytes), comm_s, float(len(steps)), sleep_s,
                         peak_rss], dtype=torch.float64)
    all_ranks = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(all_ranks, mine)
    return dict(per_rank_train_s=[float(t[0]) for t in all_ranks],
                per_rank_bytes=[int(t[1]) for t in all_ranks],
                per_rank_comm_s=[float(t[2]) for t in all_ranks],
                per_rank_steps=[int(t[3]) for t in all_ranks],
                per_rank_sleep_s=[float(t[4]) for t in all_ranks],
                per_rank_peak_rss_mb=[float(t[5]) / 2**20 for t in all_ranks])


def is_local_step(rec: dict) -> bool:
    """Whether a step record is a local step: it launched no round and its training
    thread handed nothing to collectives (an overlapped round's background thread may
    have, meanwhile: ``background_bytes``).

    >>> is_local_step(dict(averaged=False, bytes=8, background_bytes=8))
    True
    >>> is_local_step(dict(averaged=False, bytes=8)), is_local_step(dict(averaged=True, bytes=0))
    (False, False)
    """
    return not rec["averaged"] and rec["bytes"] == rec.get("background_bytes", 0)


def handle_stats(handle, node_handle=None) -> dict | None:
    """Rounds, bytes, seconds and the bytes it holds (``memory_bytes``: every kind, every
    device) of an averaging handle, and the rounds of the node rounds' one."""
    if handle is None:
        return None
    s = handle.stats
    stats = dict(rounds=s.rounds, bytes_sent=s.bytes_sent, seconds=round(s.seconds, 4),
                 wait_seconds=round(s.wait_seconds, 4),
                 memory_bytes=sum(n for kind in handle.memory_bytes().values()
                                  for n in kind.values()))
    if node_handle is not None:  # bytes inside a node vs bytes of the global rounds
        n = node_handle.stats
        stats["node"] = dict(rounds=n.rounds, bytes_sent=n.bytes_sent, seconds=round(n.seconds, 4))
    return stats


def summarize(steps: list[dict], evals: list[dict], *, rank: int, world: int, meter, slow,
              handles: tuple, train_s: float, total_bytes: int, val_wait_s: float,
              wire: tuple[int | None, int | None], stopped_by: str, eval_s: float,
              **extra) -> dict | None:
    """The summary block of ``metrics.json`` on rank 0, ``None`` on the others.

    A collective (:func:`gather_per_rank`), once ``meter`` has stopped counting.
    ``handles``: the averaging handle and the node rounds' one (:func:`handle_stats`);
    ``wire``: the transmit counter before and after the loop; ``extra``: the loop's own
    keys, last. ``median_local_step_s`` is ``None`` without local steps.
    """
    stats = handle_stats(*handles)
    meter.uninstall()
    per_rank = gather_per_rank(steps, train_s, total_bytes, slow.sleep_s, world)
    if rank != 0:
        return None
    step_s = [r["step_s"] for r in steps]
    local_s = [r["step_s"] for r in steps if is_local_step(r)]
    wire0, wire1 = wire
    return dict(
        final_val_loss=evals[-1]["val_loss"],
        final_train_loss=statistics.fmean(r["loss"] for r in steps[-max(1, len(steps) // 10):]),
        median_step_s=statistics.median(step_s),
        mean_step_s=statistics.fmean(step_s),
        train_s=train_s,
        bytes_per_step=total_bytes / len(steps),
        comm_share=sum(r["comm_s"] for r in steps) / max(train_s, 1e-12),
        val_wait_s=val_wait_s,
        median_local_step_s=statistics.median(local_s) if local_s else None,
        breakdown=breakdown(steps),
        wire_bytes_per_step=(None if wire0 is None or wire1 is None
                             else (wire1 - wire0) / len(steps)),
        **per_rank,
        uneven=slow.describe(),
        handle_stats=stats,
        stopped_by=stopped_by,
        eval_s=eval_s,
        **extra,
    )


BREAKDOWN = ("fwd_bwd_s", "grad_wait_s", "opt_s", "avg_s", "round_wait_s", "other_cpu_s")


def breakdown(steps: list[dict]) -> dict:
    """Mean seconds per step of each part of a step (see ``train.train_step``); the parts
    the records hold."""
    return {k: statistics.fmean(r[k] for r in steps) for k in BREAKDOWN
            if steps and k in steps[0]}


def run_result(args, *, world: int, n_params: int, wire_if: str | None, ops_backend,
               summary: dict, steps: list[dict], evals: list[dict]) -> dict:
    """What ``metrics.json`` holds: the config, the summary, the step and validation records."""
    config = dict(vars(args), world_size=world, steps_done=len(steps), n_params=n_params,
                  torch=torch.__version__, wire_iface=wire_if, ops_backend=ops_backend,
                  corpus=sysconfig.get_paths()["stdlib"])
    return dict(config=config, summary=summary, steps=steps, evals=evals)


def write_metrics(out: str, result: dict) -> None:
    """``<out>/metrics.json``, replaced whole (a reader never sees half of it)."""
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, "metrics.json.tmp")
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(out, "metrics.json"))
