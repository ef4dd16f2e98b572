"""Steps to DDP's loss with and without averaging the optimizer's state at each round.

Each replica's AdamW keeps its own moments, built from its own half of the global batch;
``optimizer_state="average"`` averages them exactly at every round, beside the
parameters. Does that bring local SGD's steps to DDP's loss closer to DDP's own? Each
variant trains once per seed on loopback (the number of steps to a loss does not depend
on the link), 2 ranks, the ``bench`` preset, AdamW at lr 1e-3 after a 20-step warm-up,
period 8, validation every 20 steps; steps to DDP's loss after 200 steps are
interpolated between the two validations around it. Bytes are those of rank 0 to that
loss, against ``int4``'s. Overlapped rounds land a little later or earlier from run to
run, so the overlapped variants' figures move by a few steps between runs of a seed.

Outputs ``benchmarks/results/optimizer_state_steps.json`` and the section "Fewer steps to
the target: averaging the optimizer's state" of ``benchmarks/RESULTS.md``. About 3
minutes a seed on 2 cores.

    python benchmarks/bench_optimizer_state_steps.py --seeds 0,1,2,3,4
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from harness import launch, report

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Fewer steps to the target: averaging the optimizer's state"
STEPS, BUDGET, PERIOD, LR = 300, 200, 8, 1e-3
VARIANTS = ("ddp", "int4", "int4_optstate", "int4_streaming", "int4_streaming_optstate")


def _steps(run: dict, target: float) -> float | None:
    return report.steps_to_target(run, target, interpolate=True)


def _cell(x: float | None) -> str:
    return "not reached" if x is None else f"{x / BUDGET:.3f}"


def _lines(runs: dict[int, dict[str, dict]]) -> list[str]:
    seeds = sorted(runs)
    head = " | ".join(f"seed {s}" for s in seeds)
    lines = [f"Steps to DDP's loss at {BUDGET} steps, over DDP's {BUDGET} (interpolated); "
             "bytes sent by rank 0 to that loss over `int4`'s:", "",
             f"| variant | {head} | mean | bytes x |", "|" + "---|" * (len(seeds) + 3)]
    for name in VARIANTS[1:]:
        cells, ratios, sent = [], [], []
        for s in seeds:
            target = report.loss_at_step(runs[s]["ddp"], BUDGET)
            st = _steps(runs[s][name], target)
            cells.append(_cell(st))
            if st is not None:
                ratios.append(st / BUDGET)
            b, base = (report.bytes_to_target(runs[s][v], target) for v in (name, "int4"))
            if b and base:
                sent.append(b / base)
        mean = f"{statistics.mean(ratios):.3f}" if len(ratios) == len(seeds) else "-"
        bx = f"{statistics.median(sent):.1f}" if sent else "-"
        lines.append(f"| `{name}` | " + " | ".join(cells) + f" | {mean} | {bx} |")
    return lines + [""]


def main(argv=None) -> int:
    a = launch.study_args(__doc__, "0,1,2,3,4", "optstate_steps", argv)
    t0 = time.time()
    runs: dict[int, dict[str, dict]] = {}
    for seed in (int(s) for s in a.seeds.split(",")):
        runs[seed] = {}
        for name in VARIANTS:
            args = ["--preset", "bench", "--steps", str(STEPS), "--eval-every", "20",
                    "--period", str(PERIOD), "--lr", str(LR), "--seed", str(seed),
                    "--progress", "off", "--hook", name]
            out = os.path.join(a.runs_dir, f"seed{seed}", name)
            runs[seed][name] = launch.run_training(args, out, timeout_s=a.timeout)
            print(f"seed {seed} {name}: loss @ {BUDGET} "
                  f"{report.loss_at_step(runs[seed][name], BUDGET):.4f}",
                  file=sys.stderr, flush=True)
    cmd = "python benchmarks/bench_optimizer_state_steps.py" + "".join(
        f" {x}" for x in (argv or sys.argv[1:]))
    md = [f"Command: `{cmd}` ({(time.time() - t0) / 60:.1f} min). Loopback, 2 ranks, "
          f"~1M-parameter `bench` preset, batch 8 per rank, AdamW at lr {LR:g} (after a "
          f"20-step warm-up), {STEPS} steps, period {PERIOD} (`*_streaming*`: 4 fragments, "
          "overlapped), validation every 20 steps. `*_optstate`: the same with "
          "`optimizer_state=\"average\"` (AdamW's two moments averaged exactly, in fp32, "
          "at each round; with fragments, at fragment 0's).", "", *_lines(runs)]
    report.write_section(a.results_md, "\n".join(md).rstrip() + "\n", title=SECTION)
    with open(os.path.join(HERE, "results", "optimizer_state_steps.json"), "w") as f:
        json.dump(dict(command=cmd, runs={str(s): {n: dict(config=r["config"], evals=r["evals"])
                                                   for n, r in v.items()}
                                          for s, v in runs.items()}), f, indent=1)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
