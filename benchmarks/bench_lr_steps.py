"""Steps to DDP's loss against the learning rate: does a local-SGD replica want another lr?

A local-SGD replica steps on its own batch (half DDP's global batch with 2 ranks), so the
learning rate tuned for DDP need not be the one for local SGD. Each method and lr trains
once for 400 steps on loopback (the number of steps to a loss does not depend on the link;
AdamW, constant lr after a 20-step warm-up, validation every 20 steps); steps to a target
are then interpolated between the two validations around it. Targets: DDP's loss after its
200-step budget at each DDP lr of the grid. "best lr" compares each method at its own best
lr of the grid, the fair reading: a lower lr that helps local SGD may help DDP as well.

Outputs ``benchmarks/results/lr_steps.json`` and the section "Learning rate and steps to
the target" of ``benchmarks/RESULTS.md``. About 12 minutes on 2 cores.

    python benchmarks/bench_lr_steps.py --seeds 0,1
"""
from __future__ import annotations

import os
import sys
import time

from harness import launch, report, steps_study

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Learning rate and steps to the target"
STEPS, BUDGET, PERIOD = 400, 200, 8
GRID = {"ddp": (5e-4, 7e-4, 1e-3, 1.5e-3),
        "int4_streaming": (5e-4, 7e-4, 8.5e-4, 1e-3, 1.5e-3)}
TARGET_LRS = (1e-3, 7e-4)  # DDP's lr whose loss at BUDGET steps is a target


def _fmt_steps(x: float | None) -> str:
    return "not reached" if x is None else f"{x:.0f} ({x / BUDGET:.2f}x)"


def _seed_lines(seed: int, runs: dict[tuple[str, float], dict]) -> list[str]:
    targets = {lr: report.loss_at_step(runs[("ddp", lr)], BUDGET) for lr in TARGET_LRS}
    head = " | ".join(f"steps to DDP-lr-{lr:g}'s loss {t:.4f}" for lr, t in targets.items())
    lines = [f"Seed {seed}:", "", f"| variant | lr | loss @ {BUDGET} | {head} |",
             "|" + "---|" * (3 + len(targets))]
    best: dict[tuple[str, float], float] = {}
    for (hook, lr), run in runs.items():
        cells = []
        for tlr, t in targets.items():
            st = report.steps_to_target(run, t, interpolate=True)
            cells.append(_fmt_steps(st))
            if st is not None and st < best.get((hook, tlr), float("inf")):
                best[(hook, tlr)] = st
        lines.append(f"| {hook} | {lr:g} | {report.loss_at_step(run, BUDGET):.4f} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    for tlr in TARGET_LRS:
        ours, ddp = best.get(("int4_streaming", tlr)), best.get(("ddp", tlr))
        if ours and ddp:
            lines.append(f"- DDP-lr-{tlr:g}'s loss, each method at its best lr of the grid: "
                         f"`int4_streaming` {ours:.0f} steps, DDP {ddp:.0f}: steps x "
                         f"{ours / ddp:.2f}.")
    return lines + [""]


def main(argv=None) -> int:
    a = launch.study_args(__doc__, "0,1", "lr_steps", argv)
    t0 = time.time()
    grid = {f"{hook}@{lr:g}": (hook, lr) for hook, lrs in GRID.items() for lr in lrs}
    configs = {name: ["--period", str(PERIOD), "--lr", str(lr), "--hook", hook]
               for name, (hook, lr) in grid.items()}
    runs = steps_study.train_all(configs, [int(s) for s in a.seeds.split(",")], a.runs_dir,
                                 steps=STEPS, budget=BUDGET, timeout_s=a.timeout)
    md_seeds = []
    for seed, by_name in runs.items():
        md_seeds += _seed_lines(seed, {grid[name]: run for name, run in by_name.items()})
    cmd = "python benchmarks/bench_lr_steps.py" + "".join(f" {x}" for x in (argv or sys.argv[1:]))
    md = [f"Command: `{cmd}` ({(time.time() - t0) / 60:.1f} min). Loopback, 2 ranks, "
          f"~1M-parameter `bench` preset, batch 8 per rank, AdamW (constant lr after a 20-step "
          f"warm-up), {STEPS} steps, period {PERIOD}, validation every 20 steps; steps to a "
          f"target interpolated between the validations around it, and over DDP's budget of "
          f"{BUDGET} in brackets.", "", *md_seeds]
    report.write_section(a.results_md, "\n".join(md).rstrip() + "\n", title=SECTION)
    steps_study.save(os.path.join(HERE, "results", "lr_steps.json"), cmd, runs)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
