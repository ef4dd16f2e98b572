"""Where an overlapped round's CPU goes: the averaging call and the process's other threads.

Two gloo ranks on loopback, one thread each, the training benchmark's model (``bench``
preset), one optimizer step after another. Every variant lives in the same two processes
and they take turns in blocks of 24 steps, in an order rotated per block, so the load
drifting on the shared cores reaches all of them alike; the first block is a warm-up.
Variants: ``none`` (the bare module), ``ddp`` (DDP with ``local_sgd_grad_hook``, no
rounds; the hook turns DDP's reducer off after the first backward, see
``grad_hooks.ReducerSwitch``), ``ddp_no_sync`` (DDP in ``no_sync()`` mode from the start:
its reducer skipped, no bucket copies) and ``fp16`` / ``int8`` / ``int4`` (their hook
with ``overlap=True``, ``fragments=4``, ``period=8``: a fragment's round launched every
2 steps). Per step,
means over rank 0's timed steps: the step's wall time and its ratio to ``none``'s, the
averaging call's wall time and the training thread's CPU time inside it, and the CPU
time of the process's other threads (gloo's, a registration's background thread).

``--compare PATH`` also runs the same measurement with ``ddp_avg_hooks`` imported from
another checkout (``git worktree add PATH COMMIT``), alternating with this one
``--pairs`` times: an A/B of two versions of the code in one command.

    python benchmarks/bench_round_cpu.py [--blocks 10] [--compare PATH --pairs 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = ("none", "ddp", "ddp_no_sync", "fp16", "int8", "int4")
HOOKS = {"ddp": "allreduce_hook", "fp16": "fp16_compress_hook", "int8": "int8_compress_hook",
         "int4": "int4_compress_hook"}
BLOCK_STEPS = 24
COLUMNS = ("step ms", "x none", "averaging call ms", "its thread CPU ms", "other threads' CPU ms")


def _rank(rank: int, port: int, code: str, blocks: int, queue) -> None:
    """One rank: every variant, block by block; rank 0 puts its means on ``queue``."""
    sys.path.insert(0, code)  # the checkout whose ddp_avg_hooks is measured
    sys.path.insert(0, os.path.join(HERE, "harness"))
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_avg_hooks as dah
    from train import PRESETS, CharTransformer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    shape = PRESETS["bench"]
    runs, handles = {}, []
    for name in VARIANTS:
        torch.manual_seed(0)
        model = CharTransformer(shape["d_model"], shape["n_layers"], shape["n_heads"],
                                shape["context"])
        after_step = None
        if name == "ddp_no_sync":
            model = DDP(model)
            model.require_backward_grad_sync = False  # what no_sync() sets while it lasts
        elif name != "none":
            ddp = DDP(model)
            period = 8 if name != "ddp" else 10**9  # "ddp": no round within the run
            handle = dah.register_averaging_hook(ddp, getattr(dah.hooks, HOOKS[name]), None,
                                                 period=period, warmup_steps=0,
                                                 overlap=True, fragments=4)
            ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
            model, after_step = ddp, handle.step
            handles.append(handle)
        runs[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), after_step)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (shape["batch_size"], shape["context"]), generator=gen)
    y = torch.randint(0, 256, (shape["batch_size"], shape["context"]), generator=gen)
    seen = {name: [] for name in VARIANTS}
    for block in range(blocks + 1):
        shift = block % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            model, opt, after_step = runs[name]
            dist.barrier()
            for _ in range(BLOCK_STEPS):
                t0, cpu0, own0 = time.perf_counter(), time.process_time(), time.thread_time()
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
                opt.step()
                t1, own1 = time.perf_counter(), time.thread_time()
                if after_step is not None:
                    after_step()
                t2, cpu2, own2 = time.perf_counter(), time.process_time(), time.thread_time()
                if block:  # the first block warms up
                    seen[name].append((t2 - t0, t2 - t1, own2 - own1,
                                       (cpu2 - cpu0) - (own2 - own0)))
    for handle in handles:  # the rounds still in flight finish before the group goes
        handle.synchronize()
    if rank == 0:
        queue.put({name: [statistics.mean(col) * 1e3 for col in zip(*rows)]
                   for name, rows in seen.items()})
    dist.barrier()
    dist.destroy_process_group()


def measure(code: str, blocks: int) -> dict:
    """The per-step means of every variant with ``ddp_avg_hooks`` from ``code``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, code, blocks, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        means = queue.get(timeout=1200)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    none = means["none"][0]
    return {name: [m[0], m[0] / none, m[1], m[2], m[3]] for name, m in means.items()}


def table(title: str, rows: dict) -> list[str]:
    lines = [f"{title}", "", "| variant | " + " | ".join(COLUMNS) + " |",
             "|---" * (len(COLUMNS) + 1) + "|"]
    for name, vals in rows.items():
        cells = [f"{vals[0]:.2f}", f"{vals[1]:.3f}"] + [f"{v:.2f}" for v in vals[2:]]
        if name == "none":
            cells[2:] = ["n/a"] * 3
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks of 24 steps each")
    ap.add_argument("--compare", default=None,
                    help="another checkout of the repository, measured alternately")
    ap.add_argument("--pairs", type=int, default=2, help="with --compare: runs of each")
    ap.add_argument("--out", default=None, help="also write the tables to this file")
    args = ap.parse_args()
    here = os.path.dirname(HERE)
    codes = [("this checkout", here)]
    if args.compare:
        codes.append((os.path.abspath(args.compare), os.path.abspath(args.compare)))
    lines = [f"`python benchmarks/{os.path.basename(__file__)} {' '.join(sys.argv[1:])}`",
             f"(torch {torch.__version__}, {os.cpu_count()} cores, load average "
             f"{os.getloadavg()[0]:.1f} at start; means per step of rank 0, ms)", ""]
    own_build = os.environ.get("TORCH_EXTENSIONS_DIR")
    for pair in range(args.pairs if args.compare else 1):
        for label, code in codes:
            # each checkout its own extension build, so the two never rebuild each other's
            build = own_build if code == here else os.path.join(code, ".torch_extensions")
            if build is None:
                os.environ.pop("TORCH_EXTENSIONS_DIR", None)
            else:
                os.environ["TORCH_EXTENSIONS_DIR"] = build
            part = table(f"{label}, run {pair + 1}", measure(code, args.blocks))
            lines += part
            print("\n".join(part), flush=True)
    lines.append(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
