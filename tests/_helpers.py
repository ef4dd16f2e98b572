"""What the tests share: a small seeded model, per-rank batches, flat views, one step.

Per-rank data depends only on ``(rank, step)``, so a single-process reference in the
parent can replay exactly what every rank saw.
"""

from __future__ import annotations

import functools
import gc
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

DIMS = (5, 8, 3)  # in, hidden, out


def make_model(seed: int = 0, dims: tuple[int, int, int] = DIMS) -> torch.nn.Module:
    torch.manual_seed(seed)
    d_in, hidden, d_out = dims
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, d_out))


def batch(rank: int, step: int, n: int = 6, dims: tuple[int, int, int] = DIMS):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, dims[0], generator=g), torch.randn(n, dims[-1], generator=g)


def loss_of(model, rank: int, step: int, **batch_kw) -> torch.Tensor:
    x, y = batch(rank, step, **batch_kw)
    return torch.nn.functional.mse_loss(model(x), y)


def train_step(model, opt, rank: int, step: int, **batch_kw) -> None:
    opt.zero_grad()
    loss_of(model, rank, step, **batch_kw).backward()
    opt.step()


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def flat(model_or_params) -> torch.Tensor:
    """All parameters of a module (or a list of tensors) as one new flat tensor."""
    params = (model_or_params.parameters() if isinstance(model_or_params, torch.nn.Module)
              else model_or_params)
    return torch.cat([p.detach().reshape(-1) for p in params]).clone()


def late(hook, seconds: float):
    """``hook`` whose result arrives ``seconds`` after the call (a slow link): the same
    collectives, issued at once, and the same declarations (``functools.wraps``)."""
    @functools.wraps(hook)
    def delayed(state, bucket):
        fut, result = hook(state, bucket), torch.futures.Future()

        def arrive():
            time.sleep(seconds)
            try:
                result.set_result(fut.wait())
            except Exception as exc:  # the caller's wait raises it
                result.set_exception(exc)
        threading.Thread(target=arrive, daemon=True).start()
        return result
    return delayed


def report(name, ok: bool, detail):
    """Every rank's ``(ok, detail)`` to rank 0, which prints them; raise if any failed."""
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (ok, detail))
    if dist.get_rank() == 0:
        print(f"check {name}: {'ok' if all(g[0] for g in got) else 'FAILED'} {[g[1] for g in got]}",
              flush=True)
    assert all(g[0] for g in got), (name, got)


def exit_cleanly() -> None:
    """End a torchrun check script: tear the process group down, then leave without the
    interpreter's teardown, where gloo's destructors have been seen to abort ("terminate
    called without an active exception") in torch 2.13 after every check passed."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
