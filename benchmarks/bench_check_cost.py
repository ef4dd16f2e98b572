"""What the agreement checks cost: each timed beside the work it guards.

Two gloo ranks on loopback, the training benchmark's model (``bench`` preset), AdamW.

- ``local_sgd_grad_hook``'s check that its handle averages this model (one per bucket
  and backward, while DDP calls the hook: during a warm-up, or where the reducer must
  stay on), against a warm-up step (forward, backward with gradient averaging, AdamW).
- ``optimizer_state="average"``'s check that every rank holds the same state tensors
  (``policies.check_buckets_agree``: one small all-gather before each round), against a
  whole round (``handle.average()``: the parameters and both moments averaged exactly).
- ``handle.align_anchors``, the checksum comparison at registration without a warm-up and
  at the warm-up's end (once a run; here with anchors kept, so that it runs), against the
  same round.

Means over rank 0's repetitions; the ratio is the check's share of what it guards.

    python benchmarks/bench_check_cost.py [--reps 200]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## The cost of the agreement checks"


def _mean_s(fn, reps: int) -> float:
    fn()  # warm
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _rank(rank: int, port: int, reps: int, out: str) -> None:
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    from harness import train

    import ddp_avg_hooks as dah
    from ddp_avg_hooks.policies import OptimizerStateAveraging, check_buckets_agree

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.set_num_threads(1)
    args = train.parse_args(["--preset", "bench"])
    torch.manual_seed(0)
    model = train.CharTransformer(args.d_model, args.n_layers, args.n_heads, args.context)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=8,
                                         warmup_steps=10**9, optimizer=opt,
                                         optimizer_state="average", keep_anchor=True)
    buckets = []

    def keep_bucket(state, bucket):
        buckets.append(bucket)
        return dah.grad_hooks.local_sgd_grad_hook(state, bucket)

    ddp.register_comm_hook(handle, keep_bucket)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (args.batch_size, args.context), generator=gen)

    def step():
        opt.zero_grad()
        ddp(x).float().logsumexp(-1).mean().backward()
        opt.step()

    step_s = _mean_s(step, max(reps // 10, 5))
    bucket = buckets[-1]
    hook_check_s = _mean_s(lambda: any(handle.averages(p) for p in bucket.parameters()),
                           reps * 10) * len(set(b.index() for b in buckets))
    # the state buckets a round averages, as the registration's policy builds them
    policy = OptimizerStateAveraging(opt, [p for b in handle.buckets for p in b.parameters()],
                                     25.0)
    extras = policy.buckets()
    layout_s = _mean_s(lambda: check_buckets_agree([policy], extras, handle.process_group,
                                                   "bench"), reps)
    round_s = _mean_s(handle.average, max(reps // 10, 5))
    align_s = _mean_s(lambda: dah.handle.align_anchors(handle.buckets, handle.process_group),
                      reps)
    if rank == 0:
        rows = [("comm hook: the handle averages this model (per backward, all buckets)",
                 hook_check_s, "a warm-up step", step_s),
                ("optimizer_state: the ranks' state tensors agree (per round)", layout_s,
                 "a round with both moments", round_s),
                ("anchors agree (at registration / the warm-up's end, once a run)", align_s,
                 "a round with both moments", round_s)]
        torch.save(rows, out)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--results-md", default=os.path.join(HERE, "RESULTS.md"))
    a = p.parse_args(argv)
    sys.path.insert(0, HERE)
    from harness import report

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(HERE, os.pardir, "out", "check_cost.pt")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    t0 = time.time()
    mp.spawn(_rank, args=(port, a.reps, out), nprocs=2)
    rows = torch.load(out)
    cmd = "python benchmarks/bench_check_cost.py" + "".join(f" {x}" for x in (argv or sys.argv[1:]))
    md = [f"Command: `{cmd}` ({(time.time() - t0) / 60:.1f} min). Loopback, 2 gloo ranks, "
          "~1M-parameter `bench` preset, batch 8 per rank, AdamW; means over rank 0's "
          "repetitions.", "",
          "| check | ms per call | guards | its ms | share |", "|---|---|---|---|---|",
          *[f"| {name} | {c * 1e3:.4f} | {what} | {w * 1e3:.2f} | {c / w:.3%} |"
            for name, c, what, w in rows], ""]
    report.write_section(a.results_md, "\n".join(md), title=SECTION)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
