"""``make demo``: plain DDP against local SGD (period 8) on a real model, at equal time.

Runs :mod:`harness.train` with 2 CPU processes: first ``ddp`` for ``--steps`` steps, then
our ``allreduce``, ``fp16`` and ``powersgd`` hooks, each with DDP's measured training time
as its budget (``--time-budget``; validation is not on that clock). It prints a table
(steps done, validation loss at equal time, time to reach DDP's final validation loss,
speedup over DDP to that loss, time per step, MB sent per step; see
:func:`harness.report.summarize_equal_time`) and writes a PNG plot of validation loss
against training time and against MB sent. Every run validates each ``--eval-every-s``
seconds of training.

As root with ``ip netns`` the two ranks run as two torchrun "nodes" in two network
namespaces joined by a veth pair shaped to 100 Mbit/s (``tc tbf``); otherwise on loopback.
The output says which. ``--network loopback`` forces loopback.

    PYTHONPATH=benchmarks python -m harness.demo [--steps 40] [--out out/demo]
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
BASELINE = "ddp"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="DDP's steps (its time is the budget)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="upper limit on the other variants' steps (default: 10 x --steps)")
    p.add_argument("--eval-every-s", type=float, default=0.75,
                   help="validate each time the training clock passes a multiple of this")
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
    if BASELINE in variants:  # the baseline runs first: its training time is everyone's budget
        variants.remove(BASELINE)
        variants.insert(0, BASELINE)

    profile = None
    if a.network != "loopback":
        ok, why = netns.netns_available()
        if ok:
            profile = netns.PROFILES["100mbit" if a.network == "auto" else a.network]
        else:
            print(f"network namespaces unavailable ({why}): running on loopback", file=sys.stderr)
    common = ["--preset", a.preset, "--period", str(a.period), "--warmup", str(a.warmup),
              "--eval-every", "0", "--eval-every-s", str(a.eval_every_s)]
    max_steps = a.max_steps or 10 * a.steps

    runs: dict[str, dict] = {}
    budget = None
    network = "loopback (one host, no shaping)"
    for v in variants:  # a fresh namespace pair per run: no state carries over
        limit = ["--steps", str(a.steps)] if budget is None else \
            ["--steps", str(max_steps), "--time-budget", f"{budget:.4f}"]
        with (netns.NetnsPair(profile) if profile else contextlib.nullcontext()) as pair:
            network = pair.describe() if pair else network
            print(f"--- {v} | network: {network}"
                  + (f" | budget {budget:.1f} s of training" if budget else ""), file=sys.stderr)
            runs[v] = launch.run_training([*common, *limit, "--hook", v], os.path.join(a.out, v),
                                          pair=pair, timeout_s=a.timeout, stream=True)
        if v == BASELINE:
            budget = runs[v]["summary"]["train_s"]
        if budget is not None and runs[v]["summary"].get("stopped_by") == "steps" and v != BASELINE:
            print(f"warning: {v} hit --max-steps {max_steps} before the time budget",
                  file=sys.stderr)

    rows = report.summarize_equal_time(runs, baseline=BASELINE)
    cfg = next(iter(runs.values()))["config"]
    budget_txt = (f"equal training time: {budget:.1f} s = DDP's {a.steps} steps"
                  if budget is not None else f"{a.steps} steps each (no DDP run: no time budget)")
    header = (f"ddp_avg_hooks demo | torch {cfg['torch']} | cpu | world_size {cfg['world_size']} | "
              f"{cfg['n_params'] / 1e6:.2f}M-param char transformer, batch {cfg['batch_size']}x"
              f"{cfg['context']} per rank, period {a.period}, warm-up {a.warmup} | {budget_txt}, "
              f"validation every {a.eval_every_s:g} s of it | network: {network}")
    table = report.markdown_table(rows, report.DEMO_COLUMNS)
    target = runs[BASELINE]["evals"][-1]["val_loss"] if BASELINE in runs else None
    png = report.plot({network: runs}, os.path.join(a.out, "demo.png"), title=header,
                      target=target, budget_s=budget)
    print("\n" + header + "\n\n" + table + "\n")
    if target is not None:
        print(f"time to DDP's loss ({target:.3f}): interpolated between the validations around "
              f"it; speedup = DDP's time to it / the variant's")
    parts = []
    for v, r in runs.items():
        wall, tr = r["launch"]["wall_s"], r["summary"]["train_s"]
        ev = r["summary"].get("eval_s", 0.0)
        parts.append(f"{v} {wall:.0f} s ({tr:.1f} / {ev:.1f} / {wall - tr - ev:.1f})")
    print("wall-clock per run (training / validation / start-up, rendezvous and exit): "
          + ", ".join(parts))
    if skipped:
        print("not run: " + "; ".join(skipped))
    with open(os.path.join(a.out, "demo.json"), "w") as f:
        json.dump(dict(header=header, rows=rows, skipped=skipped, budget_s=budget), f, indent=1)
    print(f"plot: {png or 'not written (matplotlib missing)'}; "
          f"metrics: {a.out}/<variant>/metrics.json")
    print(f"demo took {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
