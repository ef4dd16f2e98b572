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
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah

DIM = 32
_W = torch.randn(DIM, 8, generator=torch.Generator().manual_seed(1234)) / DIM ** 0.5


def batch(gen, n=64):
    """Synthetic data: y = sum(sin(x @ W)), the same function on every rank."""
    x = torch.randn(n, DIM, generator=gen)
    return x, torch.sin(x @ _W).sum(1, keepdim=True)


def replica_spread(model, group=None):
    """Largest difference between any two ranks' copies of any parameter (collective)."""
    v = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    hi, lo = v.clone(), v.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return (hi - lo).max().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=66)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)  # DDP copies rank 0's initial parameters to every rank anyway
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(),
                                  torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    # optimizer=opt: handle.step() runs after every opt.step() and averages on schedule
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=args.period,
                                         warmup_steps=args.warmup, optimizer=opt)
    # DDP's gradient hook: average gradients during the warm-up only
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)

    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    x_val, y_val = batch(torch.Generator().manual_seed(7), 1024)
    with torch.no_grad():
        say(f"validation loss before training: {F.mse_loss(ddp.module(x_val), y_val).item():.4f}")
    worst = 0.0
    for step in range(1, args.steps + 1):
        x, y = batch(gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        rounds = handle.stats.rounds
        opt.step()
        if handle.stats.rounds > rounds:  # a round ran at this step
            spread = replica_spread(ddp.module)
            worst = max(worst, spread)
            say(f"step {step:3d}  loss {loss.item():.4f}  round {handle.stats.rounds}: "
                f"replicas differ by {spread:.1e} after averaging")
        elif step == args.warmup:
            say(f"step {step:3d}  loss {loss.item():.4f}  warm-up over: gradients stay local now")

    handle.average()  # one more round outside the schedule: every rank ends with the same model
    worst = max(worst, replica_spread(ddp.module))
    with torch.no_grad():
        say(f"validation loss after {args.steps} steps: {F.mse_loss(ddp.module(x_val), y_val).item():.4f}")

    grad_bytes = 4 * sum(q.numel() for q in ddp.parameters())  # one fp32 gradient all-reduce
    ours = args.warmup * grad_bytes + handle.stats.bytes_sent
    say(f"sent {ours / 1e3:.1f} kB: {args.warmup} warm-up gradient all-reduces + "
        f"{handle.stats.rounds} averaging rounds ({handle.stats.bytes_sent / 1e3:.1f} kB); "
        f"DDP would send {args.steps * grad_bytes / 1e3:.1f} kB ({args.steps * grad_bytes / ours:.1f}x more)")
    if worst > 1e-6:
        raise SystemExit(f"rank {rank}: replicas disagree after a round by {worst:.1e}")
    say(f"replicas agreed after every round (largest difference {worst:.1e})")
    handle.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
