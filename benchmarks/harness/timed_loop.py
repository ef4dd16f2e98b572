"""The training loop of the time-based variants (``*_timed``: ``schedules.EverySeconds``).

Each rank enters the next averaging round once ``--round-seconds`` have passed on its
own clock, so ranks take different numbers of steps. Hence, unlike ``train.py``'s loop:

- no per-step handshake (a per-step collective would put the ranks back in lockstep);
- the run ends on a round count, ``while handle.rounds_started < --rounds`` (every rank
  leaves after the same round), never on a step count;
- validation (the consensus model, as in ``train.py``) right after every
  ``--eval-every-rounds``-th round: all ranks are at the same round then, so its
  collective is safe; ``--stop-at-loss`` is decided there by rank 0 once
  ``--min-rounds`` rounds are done.

The records are ``train.py``'s: one per step of rank 0 (step, loss, step_s, bytes,
comm_s, averaged), validation records with ``train_s`` (rank 0's training clock),
``samples`` (steps summed over the ranks x batch), ``bytes`` and ``val_loss`` (plus the
round), and the summary with every rank's step count, training time and comm wait.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# variant -> (dah hook attribute, weighting)
TIMED = {"allreduce_timed": ("allreduce_hook", "steps"),
         "fp16_timed": ("fp16_compress_hook", "steps"),
         "allreduce_timed_equal": ("allreduce_hook", "equal"),
         # the same with overlap=True: a rank that enters a round first trains on
         "fp16_timed_overlap": ("fp16_compress_hook", "steps"),
         "fp16_timed_equal_overlap": ("fp16_compress_hook", "equal")}


def add_args(p) -> None:
    p.add_argument("--round-seconds", type=float, default=1.0,
                   help="*_timed: seconds on each rank's clock between averaging rounds")
    p.add_argument("--rounds", type=int, default=None,
                   help="*_timed: rounds to run (default: --time-budget / --round-seconds, "
                        "else --steps / --period)")
    p.add_argument("--eval-every-rounds", type=int, default=None,
                   help="*_timed: validate after every N-th round (default: --eval-every / --period)")
    p.add_argument("--min-rounds", type=int, default=0,
                   help="*_timed: --stop-at-loss applies from this round on")


def schedule(dah, name: str, args):
    return dah.schedules.EverySeconds(args.round_seconds, weighting=TIMED[name][1])


def round_budget(args) -> int:
    if args.rounds:
        return args.rounds
    if args.time_budget:
        return max(1, round(args.time_budget / args.round_seconds))
    return max(1, args.steps // max(args.period, 1))


def run(args, rank: int, world: int, meter, ctx: dict) -> dict | None:
    """``ctx``: what ``train._train`` built (variant, opt, sched, data, ...)."""
    variant, opt, sched = ctx["variant"], ctx["opt"], ctx["sched"]
    train_data, val_data, gen = ctx["train_data"], ctx["val_data"], ctx["gen"]
    get_batch, read_wire, slow = ctx["get_batch"], ctx["read_wire"], ctx["slow"]
    consensus_eval, raw_all_reduce = ctx["consensus_eval"], ctx["raw_all_reduce"]
    handle = variant.handle
    rounds = round_budget(args)
    every = args.eval_every_rounds or max(1, round((args.eval_every or 0) / max(args.period, 1)))
    wire_if = ctx["wire_if"]

    steps, evals = [], []
    train_s, total_bytes, eval_s = 0.0, 0, 0.0
    stopped_by = "rounds"

    val_wait_s = 0.0  # waiting for the other ranks as a validation begins (on the clock)

    def validate(i: int) -> None:
        nonlocal eval_s, train_s, val_wait_s
        waited = ctx["wait_for_ranks"](raw_all_reduce)
        train_s += waited
        val_wait_s += waited
        if steps:  # part of the step before: the records still add up to train_s
            steps[-1]["step_s"] = round(steps[-1]["step_s"] + waited, 6)
            steps[-1]["comm_s"] = round(steps[-1]["comm_s"] + waited, 6)
        te = time.perf_counter()
        n = torch.tensor([float(i)], dtype=torch.float64)
        raw_all_reduce(n)  # every rank's steps so far: uncounted, off the clock
        evals.append(dict(step=i, round=handle.rounds_started,
                          samples=int(n.item()) * args.batch_size, train_s=round(train_s, 4),
                          bytes=total_bytes,
                          val_loss=round(consensus_eval(val_data, args, raw_all_reduce), 5)))
        eval_s += time.perf_counter() - te

    dist.barrier()
    wire0 = read_wire(wire_if)
    i = 0
    while handle.rounds_started < rounds:
        t0 = time.perf_counter()
        b0 = meter.bytes
        x, y = get_batch(train_data, args.batch_size, args.context, gen)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(variant.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        grad_wait = meter.take_grad_wait()
        opt.step()
        sched.step()
        slow.after_compute(time.perf_counter() - t0 - grad_wait)
        ta = time.perf_counter()
        averaged = bool(handle.step())
        avg_s = time.perf_counter() - ta  # every step: deferred phases and late write-backs too
        dt = time.perf_counter() - t0
        nbytes = meter.bytes - b0
        train_s += dt
        total_bytes += nbytes
        steps.append(dict(step=i, loss=round(loss.item(), 5), step_s=round(dt, 6), bytes=nbytes,
                          comm_s=round(grad_wait + avg_s, 6), averaged=averaged))
        i += 1
        k = handle.rounds_started
        if averaged and k < rounds and k % every == 0:
            validate(i)
            if args.stop_at_loss is not None and k >= args.min_rounds:
                stop = torch.tensor([float(rank == 0 and evals[-1]["val_loss"] <= args.stop_at_loss)])
                raw_all_reduce(stop)
                if stop.item() > 0:
                    stopped_by = "stop_at_loss"
                    break
    handle.synchronize()  # overlap: the last round in flight is applied before the final score
    wire1 = read_wire(wire_if)
    if not (evals and evals[-1]["round"] == handle.rounds_started and evals[-1]["step"] == i):
        validate(i)
    evals[-1]["final"] = True
    s = handle.stats
    stats = dict(rounds=s.rounds, bytes_sent=s.bytes_sent, seconds=round(s.seconds, 4))
    meter.uninstall()
    comm = sum(r["comm_s"] for r in steps)
    mine = torch.tensor([train_s, float(total_bytes), comm, float(len(steps)), slow.sleep_s],
                        dtype=torch.float64)
    all_ranks = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(all_ranks, mine)
    if rank != 0:
        return None
    step_s = [r["step_s"] for r in steps]
    summary = dict(
        final_val_loss=evals[-1]["val_loss"],
        final_train_loss=statistics.fmean(r["loss"] for r in steps[-max(1, len(steps) // 10):]),
        median_step_s=statistics.median(step_s),
        mean_step_s=statistics.fmean(step_s),
        train_s=train_s,
        bytes_per_step=total_bytes / len(steps),
        comm_share=comm / max(train_s, 1e-12),
        val_wait_s=val_wait_s,
        median_local_step_s=statistics.median([r["step_s"] for r in steps if not r["averaged"]
                                               and r["bytes"] == 0] or [float("nan")]),
        wire_bytes_per_step=None if wire0 is None or wire1 is None else (wire1 - wire0) / len(steps),
        per_rank_train_s=[float(t[0]) for t in all_ranks],
        per_rank_bytes=[int(t[1]) for t in all_ranks],
        per_rank_comm_s=[float(t[2]) for t in all_ranks],
        per_rank_steps=[int(t[3]) for t in all_ranks],
        per_rank_sleep_s=[float(t[4]) for t in all_ranks],
        uneven=slow.describe(),
        handle_stats=stats,
        stopped_by=stopped_by,
        eval_s=eval_s,
        rounds_budget=rounds,
        round_seconds=args.round_seconds,
    )
    if summary["median_local_step_s"] != summary["median_local_step_s"]:  # NaN: none
        summary["median_local_step_s"] = None
    result = dict(config=dict(vars(args), world_size=world, steps_done=len(steps),
                              n_params=ctx["n_params"], torch=torch.__version__, wire_iface=wire_if,
                              ops_backend=ctx["ops_backend"], corpus=sysconfig.get_paths()["stdlib"]),
                  summary=summary, steps=steps, evals=evals)
    print(f"[{args.hook}] world={world} rounds={s.rounds} steps per rank="
          f"{summary['per_rank_steps']} val_loss={summary['final_val_loss']:.4f} "
          f"median_step={summary['median_step_s'] * 1e3:.1f}ms", file=sys.stderr)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tmp = os.path.join(args.out, "metrics.json.tmp")
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, os.path.join(args.out, "metrics.json"))
    return result
