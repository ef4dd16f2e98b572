"""One averaging round: ``handle.average()`` vs PyTorch's ``average_parameters``.

World size 1 (gloo, in this process, 1 thread), so the round is all copies and no wire:
what is measured is the cost our bucket machinery adds around a collective. Both paths
average the same ~28M-parameter transformer-shaped model; a second copy of it is
registered with ``zero_copy=True``, where the round copies nothing.

    python benchmarks/bench_round.py [--threads 1] [--layers 8] [--width 512]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.utils import average_parameters
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.benchmark import Timer

import ddp_avg_hooks as dah


def transformer_like(layers: int, width: int, vocab: int) -> torch.nn.Module:
    """Embedding, ``layers`` encoder blocks and an output head: many tensors of mixed sizes."""
    block = lambda: torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True)
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, width),
        *[block() for _ in range(layers)],
        torch.nn.LayerNorm(width),
        torch.nn.Linear(width, vocab),
    )


def largest_allocation(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=3500)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = transformer_like(args.layers, args.width, args.vocab)
    ddp = DDP(model)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)

    # correctness once before timing: at world size 1 both must leave the values as they are
    before = [p.detach().clone() for p in params]
    ptrs = [p.data_ptr() for p in params]
    handle.average()
    assert [p.data_ptr() for p in params] == ptrs, "our round must write in place"
    average_parameters(iter(params), dist.group.WORLD)
    moved = sum(a != p.data_ptr() for a, p in zip(ptrs, params))
    assert all(torch.equal(p, b) for p, b in zip(params, before))

    ours = Timer("handle.average()", globals={"handle": handle}).blocked_autorange(min_run_time=2)
    theirs = Timer("average_parameters(iter(params), group)",
                   globals={"average_parameters": average_parameters, "params": params,
                            "group": dist.group.WORLD}).blocked_autorange(min_run_time=2)
    alloc_ours = largest_allocation(handle.average)
    alloc_theirs = largest_allocation(lambda: average_parameters(iter(params), dist.group.WORLD))

    print(f"torch {torch.__version__} | cpu | world_size 1 | threads {args.threads} | "
          f"ops backend {dah.ops.backend()} | {numel / 1e6:.1f}M params in {len(params)} tensors, "
          f"{len(handle.buckets)} buckets")
    print(f"round  ours {ours.median * 1e3:8.2f} ms   average_parameters "
          f"{theirs.median * 1e3:8.2f} ms   speedup {theirs.median / ours.median:5.2f}x")
    print(f"largest allocation in a round: ours {alloc_ours / 2**20:.1f} MiB, "
          f"average_parameters {alloc_theirs / 2**20:.1f} MiB (model {numel * 4 / 2**20:.1f} MiB)")
    print(f"parameters moved to new storage by average_parameters: {moved} of {len(params)}")

    # zero_copy=True on a second copy of the model: the round runs on the parameters' storage
    zc_model = transformer_like(args.layers, args.width, args.vocab)
    zc_handle = dah.register_averaging_hook(DDP(zc_model), dah.hooks.allreduce_hook, None,
                                            zero_copy=True)
    zc = Timer("handle.average()", globals={"handle": zc_handle}).blocked_autorange(min_run_time=2)
    extra = dah.memory.total(zc_handle.memory_bytes()) / (numel * 4)
    print(f"round  zero_copy {zc.median * 1e3:8.2f} ms   speedup over average_parameters "
          f"{theirs.median / zc.median:6.1f}x   extra memory {extra:.3f}x the model "
          f"(copying handle: {dah.memory.total(handle.memory_bytes()) / (numel * 4):.3f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
