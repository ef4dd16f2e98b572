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
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _task import (check_agreement, make_model, rank_batches, replica_spread, say, shutdown,
                   train_step, validation_loss)


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
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    groups = dah.hierarchy.node_groups(args.ranks_per_node)  # collective: every rank calls it
    say(f"{dist.get_world_size()} ranks as {groups.nodes} nodes of {groups.ranks_per_node}")
    # registered first, so at a step where both average, the node round runs first
    node = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, groups.intra,
                                       period=args.intra_period, optimizer=opt)
    world = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                        period=args.period, optimizer=opt)
    ddp.register_comm_hook(world, dah.grad_hooks.local_sgd_grad_hook)  # DDP takes one comm hook

    gen = rank_batches()
    say(f"validation loss before training: {validation_loss(ddp.module):.4f}")
    worst = 0.0
    for step in range(1, args.steps + 1):
        node_rounds, world_rounds = node.stats.rounds, world.stats.rounds
        loss = train_step(ddp, opt, gen)  # runs node.step() then world.step()
        if node.stats.rounds > node_rounds:
            in_node = replica_spread(ddp.module, groups.intra)
            everywhere = replica_spread(ddp.module)
            averaged = world.stats.rounds > world_rounds
            worst = max(worst, everywhere if averaged else in_node)
            say(f"step {step:3d}  loss {loss:.4f}  "
                f"{'node + global round' if averaged else 'node round':19s}: replicas differ by "
                f"{in_node:.1e} in the node, {everywhere:.1e} across all")
    say(f"validation loss after {args.steps} steps: {validation_loss(ddp.module):.4f}")
    say(f"node rounds: {node.stats.rounds}, {node.stats.bytes_sent / 1e3:.1f} kB inside the node; "
        f"global rounds: {world.stats.rounds}, "
        f"{world.stats.bytes_sent / 1e3:.1f} kB across the nodes")
    check_agreement(worst)
    node.remove()
    world.remove()


if __name__ == "__main__":
    main()
    shutdown()
