"""Where in training the period costs steps: a short period early, late, or throughout.

Local SGD at period 8 needs more steps than DDP to reach DDP's loss, more on some seeds
than others. Is the cost paid early (when the loss falls fastest, and the replicas
drift apart most) or all along? Each configuration trains once per seed on loopback
(``harness/steps_study.py``): exact averaging at period 1 and 8 bound it; ``int4_overlap``
(4-bit rounds overlapped with training) at period 8, and with a short period for the
first steps (``schedules.PostLocalPeriod``: period 2 until step 100, or 4 until step
120, then 8) or for the steps after 100 (8, then 4).

Outputs ``benchmarks/results/period_steps.json`` and the section "Fewer steps to the
target: where the period costs steps" of ``benchmarks/RESULTS.md``. About 5 minutes a
seed on 2 cores.

    python benchmarks/bench_period_steps.py --seeds 0,1,2,3,4
"""
from __future__ import annotations

import os
import sys
import time

from harness import launch, report, steps_study

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Fewer steps to the target: where the period costs steps"
STEPS, BUDGET, LR = 300, 200, 1e-3
CONFIGS = {
    "ddp": ["--hook", "ddp"],
    "allreduce, period 1": ["--hook", "allreduce", "--period", "1"],
    "allreduce, period 8": ["--hook", "allreduce", "--period", "8"],
    "int4_overlap, period 8": ["--hook", "int4_overlap", "--period", "8"],
    "int4_overlap, period 2 to step 100, then 8": ["--hook", "int4_overlap", "--period", "2",
                                                   "--period-after", "100:8"],
    "int4_overlap, period 4 to step 120, then 8": ["--hook", "int4_overlap", "--period", "4",
                                                   "--period-after", "120:8"],
    "int4_overlap, period 8 to step 100, then 4": ["--hook", "int4_overlap", "--period", "8",
                                                   "--period-after", "100:4"],
}


def main(argv=None) -> int:
    a = launch.study_args(__doc__, "0,1,2,3,4", "period_steps", argv)
    t0 = time.time()
    configs = {name: ["--lr", str(LR), *flags] for name, flags in CONFIGS.items()}
    runs = steps_study.train_all(configs, [int(s) for s in a.seeds.split(",")], a.runs_dir,
                                 steps=STEPS, budget=BUDGET, timeout_s=a.timeout)
    cmd = "python benchmarks/bench_period_steps.py" + "".join(
        f" {x}" for x in (argv or sys.argv[1:]))
    md = [f"Command: `{cmd}` ({(time.time() - t0) / 60:.1f} min). Loopback, 2 ranks, "
          f"~1M-parameter `bench` preset, batch 8 per rank, AdamW at lr {LR:g} (after a "
          f"20-step warm-up), {STEPS} steps, validation every 20 steps. `allreduce`: exact "
          "blocking rounds; `int4_overlap`: 4-bit rounds overlapped with training, with "
          "the period changing at a step by `schedules.PostLocalPeriod`.", "",
          f"Steps to DDP's loss at {BUDGET} steps, over DDP's {BUDGET} (interpolated); bytes "
          "sent by rank 0 to that loss over `int4_overlap, period 8`'s:", "",
          *steps_study.table(runs, list(CONFIGS)[1:], budget=BUDGET,
                             bytes_base="int4_overlap, period 8")]
    report.write_section(a.results_md, "\n".join(md).rstrip() + "\n", title=SECTION)
    steps_study.save(os.path.join(HERE, "results", "period_steps.json"), cmd, runs)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
