"""``make demo``: plain DDP against local SGD (period 8) on a real model, side by side.

Runs :mod:`harness.train` with 2 CPU processes for ``ddp`` and for our
``allreduce``, ``fp16`` and ``powersgd`` hooks, then prints a table (final validation loss,
time per step, MB sent per step, speedup over DDP) and writes a PNG plot of validation
loss against wall-clock time and against MB sent.

As root with ``ip netns`` the two ranks run as two torchrun "nodes" in two network
namespaces joined by a veth pair shaped to 100 Mbit/s (``tc tbf``); otherwise on loopback.
The output says which. ``--network loopback`` forces loopback.

    PYTHONPATH=benchmarks python -m harness.demo [--steps 240] [--out out/demo]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from . import launch, netns, report
from .train import split_available

VARIANTS = ["ddp", "allreduce", "fp16", "powersgd"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--preset", default="demo")
    p.add_argument("--network", choices=("auto", "100mbit", "1gbit", "loopback"), default="auto")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=os.path.join("out", "demo"))
    p.add_argument("--timeout", type=float, default=240, help="seconds per training run")
    a = p.parse_args(argv)
    t_start = time.perf_counter()

    variants, skipped = split_available(a.variants)
    for s in skipped:
        print(f"skipping {s}", file=sys.stderr)

    profile = None
    if a.network != "loopback":
        ok, why = netns.netns_available()
        if ok:
            profile = netns.PROFILES["100mbit" if a.network == "auto" else a.network]
        else:
            print(f"network namespaces unavailable ({why}): running on loopback", file=sys.stderr)
    common = ["--preset", a.preset, "--steps", str(a.steps), "--period", str(a.period),
              "--warmup", str(a.warmup), "--eval-every", str(max(a.steps // 8, 1))]

    runs: dict[str, dict] = {}
    network = "loopback (one host, no shaping)"
    for v in variants:  # a fresh namespace pair per run: no state carries over
        with (netns.NetnsPair(profile) if profile else contextlib.nullcontext()) as pair:
            network = pair.describe() if pair else network
            print(f"--- {v} | network: {network}", file=sys.stderr)
            runs[v] = launch.run_training([*common, "--hook", v], os.path.join(a.out, v),
                                          pair=pair, timeout_s=a.timeout, stream=True)

    rows = report.summarize(runs)
    cfg = next(iter(runs.values()))["config"]
    header = (f"ddp_avg_hooks demo | torch {cfg['torch']} | cpu | world_size {cfg['world_size']} | "
              f"{cfg['n_params'] / 1e6:.2f}M-param char transformer, batch {cfg['batch_size']}x"
              f"{cfg['context']} per rank, {a.steps} steps, period {a.period}, warm-up {a.warmup} "
              f"| network: {network}")
    table = report.markdown_table(rows, report.DEMO_COLUMNS)
    png = report.plot({network: runs}, os.path.join(a.out, "demo.png"), title=header)
    print("\n" + header + "\n\n" + table + "\n")
    if skipped:
        print("not run: " + "; ".join(skipped))
    with open(os.path.join(a.out, "demo.json"), "w") as f:
        json.dump(dict(header=header, rows=rows, skipped=skipped), f, indent=1)
    print(f"plot: {png or 'not written (matplotlib missing)'}; metrics: {a.out}/<variant>/metrics.json")
    print(f"demo took {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
