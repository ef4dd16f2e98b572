"""Local SGD on DDP: each replica takes ``period`` steps on its own, then they average.

    torchrun --nproc-per-node 2 examples/local_sgd.py [--steps 66] [--period 8] [--warmup 10]

A small MLP learns a synthetic regression task; every rank draws its own batches. For the
first ``--warmup`` steps DDP averages gradients as usual; after that gradients stay local
and ``hooks.allreduce_hook`` averages the parameters exactly every ``--period`` steps.
Rank 0 prints the loss at each round, how far apart the replicas are right after it
(exact averaging: not at all), and the bytes sent compared with plain DDP.
"""
import argparse

import torch
import torch.distributed as dist
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
    for step in range(1, args.steps + 1):
        rounds = handle.stats.rounds
        loss = train_step(ddp, opt, gen)
        if handle.stats.rounds > rounds:  # a round ran at this step
            spread = replica_spread(ddp.module)
            worst = max(worst, spread)
            say(f"step {step:3d}  loss {loss:.4f}  round {handle.stats.rounds}: "
                f"replicas differ by {spread:.1e} after averaging")
        elif step == args.warmup:
            say(f"step {step:3d}  loss {loss:.4f}  warm-up over: gradients stay local now")

    handle.average()  # one more round outside the schedule: every rank ends with the same model
    worst = max(worst, replica_spread(ddp.module))
    say(f"validation loss after {args.steps} steps: {validation_loss(ddp.module):.4f}")

    warmup_bytes = ddp_bytes(ddp, args.warmup)  # gradient all-reduces during the warm-up
    ours, ddp_sent = warmup_bytes + handle.stats.bytes_sent, ddp_bytes(ddp, args.steps)
    say(f"sent {ours / 1e3:.1f} kB: {args.warmup} warm-up gradient all-reduces + "
        f"{handle.stats.rounds} averaging rounds ({handle.stats.bytes_sent / 1e3:.1f} kB); "
        f"DDP would send {ddp_sent / 1e3:.1f} kB ({ddp_sent / ours:.1f}x more)")
    check_agreement(worst)
    handle.remove()


if __name__ == "__main__":
    main()
    shutdown()
