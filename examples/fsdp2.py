"""Local SGD over FSDP2 shards: replica groups that shard the model, averaged every period.

    torchrun --nproc-per-node 4 examples/fsdp2.py [--shards 2] [--steps 60] [--period 8]
        [--warmup 10] [--dir runs/fsdp2]

HSDP built by hand. The ranks form ``world / shards`` replica groups of ``--shards`` ranks;
each replica group ``fully_shard``s the model per layer over its own 1-D "shard" mesh and
trains synchronously inside the group, as FSDP2 does. Across replica groups nothing is
sent per step after ``--warmup``: every ``--period`` steps each rank averages its local
shards with the ranks that hold the same shards in the other replica groups, over the
"replicate" group. During the warm-up the reduce-scattered gradient shards are averaged
over that group too (native HSDP), through ``grad_hooks.register_fsdp_grad_hooks``.

With ``--dir``, a ``RoundCheckpointer`` saves after every round (each rank its own shards)
and the program resumes the newest round when started again with the same ``--dir``.
Rank 0 prints the loss at each round and how far the replicas are apart right after it
(exact averaging: not at all).
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ddp_avg_hooks as dah
from _task import make_model, say, shutdown, train_step, validation_loss


def replica_spread(model, replicate) -> float:
    """Largest difference between this rank's shards and the same shards elsewhere."""
    v = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    hi, lo = v.clone(), v.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=replicate)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=replicate)
    spread = (hi - lo).abs().max() if v.numel() else torch.zeros(())
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    return spread.item()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="ranks per replica group")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--dir", default=None, help="round checkpoints (resumed if present)")
    args = p.parse_args()

    dist.init_process_group("gloo")
    replicas = dist.get_world_size() // args.shards
    # one row per replica group: mesh["shard"] is this rank's group, mesh["replicate"] the
    # ranks holding the same shards in every replica group
    mesh = init_device_mesh("cpu", (replicas, args.shards), mesh_dim_names=("replicate", "shard"))
    replicate = mesh["replicate"].get_group()

    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # the replicate group is the hook's state, as a process group is for DDP
    handle = dah.register_averaging_hook(model, dah.hooks.allreduce_hook, replicate,
                                         period=args.period, warmup_steps=args.warmup,
                                         optimizer=opt)
    dah.grad_hooks.register_fsdp_grad_hooks(model, handle)  # averaged during the warm-up only
    ckpt = None
    if args.dir:
        ckpt = dah.checkpoint.RoundCheckpointer(args.dir, handle, model, opt)
        restored = ckpt.restore()
        if restored is not None:
            say(f"resumed round {restored} at step {handle.step_count}")

    replica = dist.get_rank() // args.shards
    worst = 0.0
    for step in range(handle.step_count + 1, args.steps + 1):
        rounds = handle.stats.rounds
        # each replica group's batch is a function of (replica group, step), so a resumed
        # run sees the data it saw the first time; its ranks share it, as FSDP wants
        loss = train_step(model, opt, torch.Generator().manual_seed(1000 * replica + step))
        if handle.stats.rounds > rounds:
            spread = replica_spread(model, replicate)
            worst = max(worst, spread)
            say(f"step {step:3d}  loss {loss:.4f}  round {handle.stats.rounds}: "
                f"replicas differ by {spread:.1e} after averaging")
            if ckpt is not None:
                ckpt.maybe_save()
    with torch.no_grad():
        full = torch.nn.utils.parameters_to_vector(p.full_tensor() for p in model.parameters())
    plain = make_model()
    torch.nn.utils.vector_to_parameters(full, plain.parameters())
    say(f"validation loss after {args.steps} steps: {validation_loss(plain):.4f}; "
        f"{handle.stats.rounds} rounds, {handle.stats.bytes_sent / 1e3:.1f} kB sent by this "
        "rank across replica groups")
    if worst > 1e-6:
        raise SystemExit(f"replicas disagree after a round by {worst:.1e}")
    say(f"replicas agreed after every round (largest difference {worst:.1e})")
    handle.remove()


if __name__ == "__main__":
    main()
    shutdown()
