"""Hierarchical averaging: exact rounds inside each node often, across all nodes rarely.

    torchrun --nproc-per-node 4 examples/hierarchical.py --ranks-per-node 2   # 2 "nodes" x 2
    torchrun --nnodes 2 --nproc-per-node 8 ... examples/hierarchical.py       # 2 real nodes

Two registrations on one model, each with its own process group and period:
``hooks.allreduce_hook`` over this rank's node (``hierarchy.node_groups``) every
``--intra-period`` steps, and over all ranks every ``--period`` steps. Gradients stay
local. Rank 0 prints how far apart the replicas are inside its node and across all
ranks after each round, and the bytes of each kind of round. Rounds run at steps
1, 1 + period, 1 + 2 * period, ... (PyTorch's ``PeriodicModelAverager`` schedule), so
the default 33 steps end on a global round: every rank holds the same model.
"""
import argparse
import os

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
    """Largest difference between any two copies of any parameter in ``group`` (collective)."""
    v = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    hi, lo = v.clone(), v.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return (hi - lo).max().item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=33)
    p.add_argument("--intra-period", type=int, default=2)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--ranks-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                   help="default: torchrun's LOCAL_WORLD_SIZE (the ranks of this machine)")
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(),
                                  torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    groups = dah.hierarchy.node_groups(args.ranks_per_node)  # collective: every rank calls it
    say(f"{dist.get_world_size()} ranks as {groups.nodes} nodes of {groups.ranks_per_node}")
    # registered first, so at a step where both average, the node round runs first
    node = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, groups.intra,
                                       period=args.intra_period, optimizer=opt)
    world = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                        period=args.period, optimizer=opt)
    ddp.register_comm_hook(world, dah.grad_hooks.local_sgd_grad_hook)  # DDP takes one comm hook

    gen = torch.Generator().manual_seed(100 + rank)
    x_val, y_val = batch(torch.Generator().manual_seed(7), 1024)
    with torch.no_grad():
        say(f"validation loss before training: {F.mse_loss(ddp.module(x_val), y_val).item():.4f}")
    worst = 0.0
    for step in range(1, args.steps + 1):
        x, y = batch(gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        node_rounds, world_rounds = node.stats.rounds, world.stats.rounds
        opt.step()  # runs node.step() then world.step()
        if node.stats.rounds > node_rounds:
            in_node, everywhere = replica_spread(ddp.module, groups.intra), replica_spread(ddp.module)
            averaged = world.stats.rounds > world_rounds
            worst = max(worst, everywhere if averaged else in_node)
            say(f"step {step:3d}  loss {loss.item():.4f}  "
                f"{'node + global round' if averaged else 'node round':19s}: replicas differ by "
                f"{in_node:.1e} in the node, {everywhere:.1e} across all")
    with torch.no_grad():
        say(f"validation loss after {args.steps} steps: {F.mse_loss(ddp.module(x_val), y_val).item():.4f}")
    say(f"node rounds: {node.stats.rounds}, {node.stats.bytes_sent / 1e3:.1f} kB inside the node; "
        f"global rounds: {world.stats.rounds}, {world.stats.bytes_sent / 1e3:.1f} kB across the nodes")
    if worst > 1e-6:
        raise SystemExit(f"rank {rank}: replicas disagree after a round by {worst:.1e}")
    say(f"replicas agreed after every round (largest difference {worst:.1e})")
    node.remove()
    world.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
