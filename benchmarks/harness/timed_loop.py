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

import sys
import time

import torch
import torch.distributed as dist

if __package__:
    from . import records
else:  # run by train.py as a script: this folder is sys.path[0]
    import records


def add_args(p) -> None:
    p.add_argument("--round-seconds", type=float, default=1.0,
                   help="*_timed: seconds on each rank's clock between averaging rounds")
    p.add_argument("--rounds", type=int, default=None,
                   help="*_timed: rounds to run (default: --time-budget / --round-seconds, "
                        "else --steps / --period)")
    p.add_argument("--eval-every-rounds", type=int, default=None,
                   help="*_timed: validate after every N-th round (default: --eval-every / "
                        "--period)")
    p.add_argument("--min-rounds", type=int, default=0,
                   help="*_timed: --stop-at-loss applies from this round on")


def schedule(dah, spec, args):
    """The rounds of ``spec`` (a ``variants.TIMED`` record): every ``--round-seconds``."""
    return dah.schedules.EverySeconds(args.round_seconds, weighting=spec.weighting)


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
    get_batch, train_step, slow = ctx["get_batch"], ctx["train_step"], ctx["slow"]
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
        waited = records.wait_before_validation(steps, ctx["wait_for_ranks"], raw_all_reduce)
        train_s += waited
        val_wait_s += waited
        te = time.perf_counter()
        n = torch.tensor([float(i)], dtype=torch.float64)
        raw_all_reduce(n)  # every rank's steps so far: uncounted, off the clock
        evals.append(dict(step=i, round=handle.rounds_started,
                          samples=int(n.item()) * args.batch_size, train_s=round(train_s, 4),
                          bytes=total_bytes,
                          val_loss=round(consensus_eval(val_data, args, raw_all_reduce), 5)))
        eval_s += time.perf_counter() - te

    dist.barrier()
    wire0 = records.read_wire(wire_if)
    i = 0
    while handle.rounds_started < rounds:
        t0 = time.perf_counter()
        b0, g0 = meter.counts()
        batch = get_batch(train_data, args.batch_size, args.context, gen)
        # variant.after_step is handle.step
        loss, grad_wait, averaged, avg_s, parts = train_step(variant, opt, sched, meter, slow,
                                                             batch, t0)
        dt = time.perf_counter() - t0
        b1, g1 = meter.counts()
        nbytes = b1 - b0
        train_s += dt
        total_bytes += nbytes
        steps.append(dict(step=i, loss=round(loss.item(), 5), step_s=round(dt, 6), bytes=nbytes,
                          background_bytes=g1 - g0,
                          comm_s=round(grad_wait + avg_s, 6), averaged=averaged,
                          grad_wait_s=round(grad_wait, 6), **parts))
        i += 1
        k = handle.rounds_started
        if averaged and k < rounds and k % every == 0:
            validate(i)
            if args.stop_at_loss is not None and k >= args.min_rounds:
                stop = torch.tensor(
                    [float(rank == 0 and evals[-1]["val_loss"] <= args.stop_at_loss)])
                raw_all_reduce(stop)
                if stop.item() > 0:
                    stopped_by = "stop_at_loss"
                    break
    handle.synchronize()  # overlap: the last round in flight is applied before the final score
    wire1 = records.read_wire(wire_if)
    if not (evals and evals[-1]["round"] == handle.rounds_started and evals[-1]["step"] == i):
        validate(i)
    evals[-1]["final"] = True
    summary = records.summarize(
        steps, evals, rank=rank, world=world, meter=meter, slow=slow, handles=(handle,),
        train_s=train_s, total_bytes=total_bytes, val_wait_s=val_wait_s, wire=(wire0, wire1),
        stopped_by=stopped_by, eval_s=eval_s, rounds_budget=rounds,
        round_seconds=args.round_seconds)
    if summary is None:  # not rank 0
        return None
    result = records.run_result(args, world=world, n_params=ctx["n_params"], wire_if=wire_if,
                                ops_backend=ctx["ops_backend"], summary=summary, steps=steps,
                                evals=evals)
    print(f"[{args.hook}] world={world} rounds={summary['handle_stats']['rounds']} steps per rank="
          f"{summary['per_rank_steps']} val_loss={summary['final_val_loss']:.4f} "
          f"median_step={summary['median_step_s'] * 1e3:.1f}ms", file=sys.stderr)
    if args.out:
        records.write_metrics(args.out, result)
    return result
