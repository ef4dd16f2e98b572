"""Local SGD on DDP: each replica takes ``period`` steps on its own, then they average.

    torchrun --nproc-per-node 2 examples/local_sgd.py [--steps 66] [--period 8] [--warmup 10]
    torchrun --nproc-per-node 2 examples/local_sgd.py --uneven 20    # rank 1: 20 batches fewer

A small MLP learns a synthetic regression task; every rank draws its own batches. For the
first ``--warmup`` steps DDP averages gradients as usual; after that gradients stay local
and ``hooks.allreduce_hook`` averages the parameters exactly every ``--period`` steps.
Rank 0 prints the loss at each round, how far apart the replicas are right after it
(exact averaging: not at all), and the bytes sent compared with plain DDP.

With ``--uneven N`` rank r has ``r * N`` batches fewer, and the loop runs inside
``Join([ddp, handle])``: a rank out of batches keeps taking part in the others' rounds,
so no round waits for it. The replicas are then compared once, at the end (comparing
them needs every rank).
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _task import (check_agreement, ddp_bytes, make_model, rank_batches, replica_spread, say,
                   shutdown, train_step, validation_loss)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=66)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--uneven", type=int, default=0,
                   help="rank r has r * UNEVEN batches fewer (trained inside Join)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    # optimizer=opt: handle.step() runs after every opt.step() and averages on schedule
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=args.period,
                                         warmup_steps=args.warmup, optimizer=opt)
    # DDP's gradient hook: average gradients during the warm-up only
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)

    gen = rank_batches()
    say(f"validation loss before training: {validation_loss(ddp.module):.4f}")
    worst = 0.0
    my_steps = args.steps - dist.get_rank() * args.uneven
    # Join: a rank whose batches ran out stands in for the others' steps (no-op if even)
    with Join([ddp, handle], enable=args.uneven > 0):
        for step in range(1, my_steps + 1):
            rounds = handle.stats.rounds
            loss = train_step(ddp, opt, gen)
            if handle.stats.rounds > rounds:  # a round ran at this step
                spread = 0.0 if args.uneven else replica_spread(ddp.module)
                worst = max(worst, spread)
                say(f"step {step:3d}  loss {loss:.4f}  round {handle.stats.rounds}"
                    + ("" if args.uneven else f": replicas differ by {spread:.1e} after averaging"))
            elif step == args.warmup:
                say(f"step {step:3d}  loss {loss:.4f}  warm-up over: gradients stay local now")
    if args.uneven:
        say(f"{dist.get_world_size() - 1} of {dist.get_world_size()} ranks ran out of batches "
            f"early; every rank took part in all {handle.stats.rounds} rounds "
            f"({handle.step_count} steps)")

    handle.average()  # one more round outside the schedule: every rank ends with the same model
    worst = max(worst, replica_spread(ddp.module))
    say(f"validation loss after {args.steps} steps: {validation_loss(ddp.module):.4f}")

    warmup_bytes = ddp_bytes(ddp, args.warmup)  # gradient all-reduces during the warm-up
    ours, ddp_sent = warmup_bytes + handle.stats.bytes_sent, ddp_bytes(ddp, args.steps)
    say(f"sent {ours / 1e3:.1f} kB: {args.warmup} warm-up gradient all-reduces + "
        f"{handle.stats.rounds} averaging rounds ({handle.stats.bytes_sent / 1e3:.1f} kB); "
        f"DDP would send {ddp_sent / 1e3:.1f} kB ({ddp_sent / ours:.1f}x more)")
    check_agreement(worst, "at the end" if args.uneven else "after every round")
    handle.remove()


if __name__ == "__main__":
    main()
    shutdown()
