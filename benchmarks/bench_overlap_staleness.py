"""What overlap's staleness costs in loss: rounds that arrive late, emulated on loopback.

``overlap=True`` applies a round as ``params + (average - params_at_launch)`` when it
arrives, so each rank keeps the progress it made meanwhile; ``mixing=alpha`` applies it
as ``alpha * params + (1 - alpha) * average`` instead (Streaming DiLoCo's merge). How late
it arrives is set here with ``train.py --round-delay`` (the hook's future completes that
many seconds after the call: a slow link without network namespaces; the loss does not
depend on anything else about the link). Grid: periods 8 and 32, delays 0 to ~one period
of steps, against blocking rounds at the same period and no communication at all; 2 ranks,
the ~1M-parameter ``bench`` preset, AdamW lr 1e-3, 400 steps.

Outputs ``benchmarks/results/overlap_staleness.json`` and the section "Overlap staleness"
of ``benchmarks/RESULTS.md``. About 6 minutes on 2 cores.

    python benchmarks/bench_overlap_staleness.py
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from harness import launch, report

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Overlap staleness"
STEPS, LR = 400, "1e-3"
# (hook, period, delay seconds, mixing: None = add the change since launch)
GRID = [("none", 8, 0.0, None), ("allreduce", 8, 0.0, None), ("allreduce_overlap", 8, 0.0, None),
        ("allreduce_overlap", 8, 0.1, None), ("allreduce_overlap", 8, 0.2, None),
        ("allreduce_overlap", 8, 0.4, None), ("allreduce_overlap", 8, 0.2, 0.5),
        ("allreduce_overlap", 8, 0.4, 0.5), ("allreduce_overlap", 8, 0.4, 0.25),
        ("allreduce", 32, 0.0, None), ("allreduce_overlap", 32, 0.4, None),
        ("allreduce_overlap", 32, 0.4, 0.5)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs-dir", default=os.path.join(HERE, os.pardir, "out", "overlap_staleness"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--results-md", default=os.path.join(HERE, "RESULTS.md"))
    a = p.parse_args(argv)
    t0 = time.time()
    runs = {}
    for hook, period, delay, mixing in GRID:
        name = f"{hook}_p{period}_d{delay:g}" + (f"_m{mixing:g}" if mixing is not None else "")
        args = ["--preset", "bench", "--steps", str(STEPS), "--eval-every", "40", "--lr", LR,
                "--progress", "off", "--hook", hook, "--period", str(period),
                "--round-delay", str(delay)]
        args += ["--mixing", str(mixing)] if mixing is not None else []
        runs[name] = launch.run_training(args, os.path.join(a.runs_dir, name), timeout_s=a.timeout)
        print(f"{name}: val {runs[name]['evals'][-1]['val_loss']:.3f}", file=sys.stderr, flush=True)
    blocking = {r["config"]["period"]: r for r in runs.values()
                if r["config"]["hook"] == "allreduce"}
    lines = ["| variant | mixing | period | round delay s | median step ms | delay in steps | "
             "loss @ 200 | loss @ 400 | vs blocking, same period |", "|" + "---|" * 9]
    for name, run in runs.items():
        cfg, s = run["config"], run["summary"]
        step_ms = s["median_step_s"] * 1e3
        final = run["evals"][-1]["val_loss"]
        ref = blocking.get(cfg["period"]) if cfg["hook"] != "none" else None
        lines.append(" | ".join([
            f"| {cfg['hook']}", "add change" if cfg.get("mixing") is None else f"{cfg['mixing']:g}",
            str(cfg["period"]) if cfg["hook"] != "none" else "n/a",
            f"{cfg['round_delay']:g}", f"{step_ms:.1f}",
            f"{1e3 * cfg['round_delay'] / step_ms:.1f}" if cfg["round_delay"] else "0",
            f"{report.loss_at_step(run, 200):.3f}", f"{final:.3f}",
            "n/a" if ref is None else
            f"{100 * (final - ref['evals'][-1]['val_loss']) / ref['evals'][-1]['val_loss']:+.1f}%"])
            + " |")
    cmd = "python benchmarks/bench_overlap_staleness.py" + "".join(
        f" {x}" for x in (argv or sys.argv[1:]))
    typical_ms = statistics.median(r["summary"]["median_step_s"] for r in runs.values()) * 1e3
    md = [f"Command: `{cmd}` ({(time.time() - t0) / 60:.1f} min). Loopback, 2 ranks, "
          f"~1M-parameter `bench` preset, AdamW lr {LR}, {STEPS} steps; a round's result "
          f"arrives `--round-delay` seconds after launch (median step ~{typical_ms:.0f} ms, so "
          "0.4 s is about 8 steps: what one exact round of this model takes at 100 Mbit/s). "
          "Validation loss of the ranks' average model.", "", *lines]
    report.write_section(a.results_md, "\n".join(md), title=SECTION)
    with open(os.path.join(HERE, "results", "overlap_staleness.json"), "w") as f:
        json.dump(dict(command=cmd, runs={n: dict(config=r["config"], summary=r["summary"],
                                                   evals=r["evals"]) for n, r in runs.items()}),
                  f, indent=1)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
