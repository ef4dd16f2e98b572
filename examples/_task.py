"""The small task the examples train: a synthetic regression, an MLP, and two checks.

Not part of ddp_avg_hooks: the examples import it so each keeps to what it shows.
"""
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F

DIM = 32
_W = torch.randn(DIM, 8, generator=torch.Generator().manual_seed(1234)) / DIM ** 0.5


def batch(gen, n=64):
    """Synthetic data: y = sum(sin(x @ W)), the same function on every rank."""
    x = torch.randn(n, DIM, generator=gen)
    return x, torch.sin(x @ _W).sum(1, keepdim=True)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)  # DDP copies rank 0's initial parameters to every rank anyway
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


_VAL = batch(torch.Generator().manual_seed(7), 1024)


@torch.no_grad()
def validation_loss(model) -> float:
    return F.mse_loss(model(_VAL[0]), _VAL[1]).item()


def replica_spread(model, group=None) -> float:
    """Largest difference between any two copies of any parameter in ``group`` (collective)."""
    v = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    hi, lo = v.clone(), v.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    return (hi - lo).max().item()


def say(*args, **kwargs) -> None:
    """``print`` on rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, **kwargs)


def rank_batches() -> torch.Generator:
    """The generator of this rank's own training batches."""
    return torch.Generator().manual_seed(100 + dist.get_rank())


def train_step(model, opt, gen) -> float:
    """One optimizer step on a fresh batch; returns the loss."""
    x, y = batch(gen)
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def ddp_bytes(model, steps: int) -> int:
    """What plain DDP sends in ``steps`` steps: one fp32 gradient all-reduce each."""
    return steps * 4 * sum(p.numel() for p in model.parameters())


def check_agreement(worst: float, when: str = "after every round") -> None:
    """Fail if the replicas differed (``when`` they were compared); else say they agreed."""
    if worst > 1e-6:
        raise SystemExit(f"rank {dist.get_rank()}: replicas disagree {when} by {worst:.1e}")
    say(f"replicas agreed {when} (largest difference {worst:.1e})")


def shutdown() -> None:
    """Destroy the process group once DDP is gone.

    DDP's reducer keeps its last gradient future; freed after the group is destroyed (at
    interpreter exit), gloo can abort the process. So ``main()`` returns first, letting
    its model, optimizer and handle go, and the reference cycles are collected here.
    """
    gc.collect()
    dist.destroy_process_group()
