"""What the FSDP2 tests share: HSDP built by hand (a 1-D shard mesh per replica group,
averaged over the replicate group), a model with uneven and empty shards, and the
single-process reference of the same schedule.

Ranks ``r * shards ... (r + 1) * shards - 1`` form replica group ``r``; rank ``i`` of
each replica group holds the same shards, and those ranks form a replicate group.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from _helpers import batch, make_model

# Linear(5, 3) and Linear(3, 1): over 2 shards the rows split 2 + 1 and 1 + 0, so the
# second shard of the last layer is empty
DIMS = (5, 3, 1)


def mesh(shards: int):
    """``(shard mesh, replicate group)`` of this rank, from a (replicas, shards) mesh."""
    replicas = dist.get_world_size() // shards
    m = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    return m["shard"], m["replicate"].get_group()


def sharded_model(shards: int, seed: int = 0, dims=DIMS):
    """The test model, ``fully_shard``-ed per layer and at the root; and the replicate group."""
    shard_mesh, replicate = mesh(shards)
    model = make_model(seed, dims)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model, replicate


def full_params(model) -> torch.Tensor:
    """Every parameter's full tensor, flat (collective over the shard mesh)."""
    return torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])


def local_shards(model) -> torch.Tensor:
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])


def train_step(model, opt, rank: int, step: int) -> None:
    x, y = batch(rank, step, dims=DIMS)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(world: int, shards: int, steps: int, rounds_at, *, lr=0.05, momentum=0.0,
              warmup: int = 0, seed: int = 0, dims=DIMS) -> list[list[torch.Tensor]]:
    """Replica ``r`` steps on the mean gradient of its ranks' batches (of every rank's,
    during the warm-up); after the steps in ``rounds_at`` the replicas' parameters are
    averaged. Returns, per step, each replica's flat parameters."""
    replicas = world // shards
    models = [make_model(seed, dims) for _ in range(replicas)]
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum) for m in models]
    out = []
    for step in range(steps):
        grads = []
        for r, m in enumerate(models):
            ranks = range(world) if step < warmup else range(r * shards, (r + 1) * shards)
            per_rank = []
            for rank in ranks:
                x, y = batch(rank, step, dims=dims)
                m.zero_grad()
                torch.nn.functional.mse_loss(m(x), y).backward()
                per_rank.append([p.grad.clone() for p in m.parameters()])
            grads.append([torch.stack(g).mean(0) for g in zip(*per_rank)])
        for m, opt, g in zip(models, opts, grads):
            for p, gi in zip(m.parameters(), g):
                p.grad = gi
            opt.step()
        if step in rounds_at:
            mean = torch.stack([_flat(m) for m in models]).mean(0)
            with torch.no_grad():
                for m in models:  # a copy each: vector_to_parameters makes views of its input
                    torch.nn.utils.vector_to_parameters(mean.clone(), m.parameters())
        out.append([_flat(m).clone() for m in models])
    return out


def copy_model(model):
    return copy.deepcopy(model)
