"""Bytes per round and round time of each built-in averaging hook vs ``allreduce_hook``.

Spawns ``--world-size`` gloo ranks on 127.0.0.1 (1 thread each). Every rank builds the
~28M-parameter transformer-shaped model of ``bench_round.py`` from the same seed, wraps
it in DDP and, for each hook in turn: registers it (period 1), checks one round for
correctness, then times rounds. Timing follows STYLE.md: a fixed number of runs on
every rank after ``dist.barrier()`` (``max(n // 100, 2)`` warm-up runs, then ``n``),
and the all_reduce(MAX) of the per-rank times; that is repeated ``--repeat`` times and the
median reported. Each timed run first adds a fixed
rank-dependent perturbation to the parameters (so every round has a real delta to
compress); the time of that perturbation alone is measured the same way and
subtracted. "pays off" is where the bytes saved outweigh the extra time measured here,
``(allreduce bytes - hook bytes) / (hook time - allreduce time)``, as a link speed.

    python benchmarks/bench_hooks.py [--world-size 2] [-n 5] [--repeat 3] [--layers 8] [--width 512]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_round import transformer_like  # noqa: E402  (the same ~28M-parameter model)

import ddp_avg_hooks as dah  # noqa: E402

HOOKS = {
    "allreduce_hook": (dah.hooks.allreduce_hook, lambda: None),
    "fp16_compress_hook": (dah.hooks.fp16_compress_hook, lambda: None),
    "bf16_compress_hook": (dah.hooks.bf16_compress_hook, lambda: None),
    "powersgd_hook r=1": (dah.hooks.powersgd_hook,
                          lambda: dah.hooks.PowerSGDState(matrix_approximation_rank=1)),
    "powersgd_hook r=4": (dah.hooks.powersgd_hook,
                          lambda: dah.hooks.PowerSGDState(matrix_approximation_rank=4)),
}


def _timeit(fn, n: int, group=None) -> float:
    """Seconds per call: the same fixed count on every rank, max over ranks."""
    for _ in range(max(n // 100, 2)):
        fn()
    dist.barrier(group)
    start = time.perf_counter()
    for _ in range(n):
        fn()
    t = torch.tensor([(time.perf_counter() - start) / n], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _rank_main(rank: int, world_size: int, port: int, args, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        model = transformer_like(args.layers, args.width, args.vocab)
        ddp = DDP(model)
        params = [p for p in model.parameters() if p.requires_grad]
        base = [p.detach().clone() for p in params]
        g = torch.Generator().manual_seed(1 + rank)
        noise = [torch.randn(p.shape, generator=g).mul_(1e-3) for p in params]
        numel = sum(p.numel() for p in params)

        def reset() -> None:
            with torch.no_grad():
                torch._foreach_copy_(params, base)

        def perturb() -> None:
            with torch.no_grad():
                torch._foreach_add_(params, noise)

        t_perturb = statistics.median(_timeit(perturb, args.n) for _ in range(args.repeat))
        rows, exact = [], None
        for name, (hook, make_state) in HOOKS.items():
            reset()
            handle = dah.register_averaging_hook(ddp, hook, make_state())
            # correctness once before timing: ranks agree, and the error vs exact averaging
            perturb()
            handle.average()
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
            dist.all_gather(sums, flat.double().sum().reshape(1))
            assert all(torch.equal(s, sums[0]) for s in sums), f"{name}: ranks disagree"
            if exact is None:  # allreduce_hook comes first: the exact average
                exact = flat.clone()
                moved = (exact - torch.cat([b.reshape(-1) for b in base])).norm()
            rel_err = float((flat - exact).norm() / moved)
            rounds_before, bytes_before = handle.stats.rounds, handle.stats.bytes_sent

            def one_round(handle=handle) -> None:
                perturb()
                handle.average()

            t = statistics.median(_timeit(one_round, args.n)
                                  for _ in range(args.repeat)) - t_perturb
            rounds = handle.stats.rounds - rounds_before
            per_round = (handle.stats.bytes_sent - bytes_before) // rounds
            rows.append((name, per_round, t, rel_err, len(handle.buckets)))
            handle.remove()
        if rank == 0:
            torch.save({"rows": rows, "numel": numel, "tensors": len(params),
                        "t_perturb": t_perturb}, out_path)
        # Drop everything that holds the process group (DDP, hook closures) while the
        # interpreter is fully alive: a gloo group torn down at interpreter exit can abort.
        del ddp, model, handle, one_round
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("-n", type=int, default=5, help="timed rounds per hook (after warm-up)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="timings per hook; the median is reported")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=3500)
    args = ap.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, args.world_size + 1, is_master=True,
                          wait_for_workers=False)
    out_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_hooks_{os.getpid()}.pt")
    mp.start_processes(_rank_main, args=(args.world_size, store.port, args, out_path),
                       nprocs=args.world_size, join=True, start_method="spawn")
    res = torch.load(out_path)
    os.remove(out_path)
    rows = res["rows"]
    ref_bytes, ref_t = rows[0][1], rows[0][2]
    print(f"torch {torch.__version__} | cpu gloo 127.0.0.1 | world_size {args.world_size} | "
          f"threads/rank {args.threads} | ops backend {dah.ops.backend()} | "
          f"{res['numel'] / 1e6:.1f}M float32 params in {res['tensors']} tensors, "
          f"{rows[0][4]} buckets | n={args.n}, median of {args.repeat} | perturbation "
          f"{res['t_perturb'] * 1e3:.1f} ms subtracted | load avg {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    for name, nbytes, t, rel_err, _ in rows:
        # Loopback moves bytes almost for free, so extra time here is mostly compute. On a
        # link of B bytes/s the hook wins when (ref_bytes - nbytes) / B > t - ref_t.
        saved, extra = ref_bytes - nbytes, t - ref_t
        if saved <= 0:
            even = "-"
        elif extra <= 0:
            even = "always"
        else:
            even = f"below {saved * 8 / extra / 1e9:.2f} Gbit/s"
        print(f"{name:20s} bytes/round/rank {nbytes / 2**20:8.2f} MiB "
              f"({ref_bytes / nbytes:6.1f}x less)  "
              f"round {t * 1e3:8.1f} ms ({t / ref_t:5.2f}x of allreduce)  pays off: {even:22s}  "
              f"|new - exact| / |exact - old| {rel_err:.2e}")


if __name__ == "__main__":
    main()
