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

import os
import sys
import time

from harness import launch, report, steps_study

HERE = os.path.dirname(os.path.abspath(__file__))
SECTION = "## Fewer steps to the target: averaging the optimizer's state"
STEPS, BUDGET, PERIOD, LR = 300, 200, 8, 1e-3
VARIANTS = ("ddp", "int4", "int4_optstate", "int4_streaming", "int4_streaming_optstate")


def main(argv=None) -> int:
    a = launch.study_args(__doc__, "0,1,2,3,4", "optstate_steps", argv)
    t0 = time.time()
    configs = {name: ["--period", str(PERIOD), "--lr", str(LR), "--hook", name]
               for name in VARIANTS}
    runs = steps_study.train_all(configs, [int(s) for s in a.seeds.split(",")], a.runs_dir,
                                 steps=STEPS, budget=BUDGET, timeout_s=a.timeout)
    cmd = "python benchmarks/bench_optimizer_state_steps.py" + "".join(
        f" {x}" for x in (argv or sys.argv[1:]))
    md = [f"Command: `{cmd}` ({(time.time() - t0) / 60:.1f} min). Loopback, 2 ranks, "
          f"~1M-parameter `bench` preset, batch 8 per rank, AdamW at lr {LR:g} (after a "
          f"20-step warm-up), {STEPS} steps, period {PERIOD} (`*_streaming*`: 4 fragments, "
          "overlapped), validation every 20 steps. `*_optstate`: the same with "
          "`optimizer_state=\"average\"` (AdamW's two moments averaged exactly, in fp32, "
          "at each round; with fragments, at fragment 0's).", "",
          f"Steps to DDP's loss at {BUDGET} steps, over DDP's {BUDGET} (interpolated); "
          "bytes sent by rank 0 to that loss over `int4`'s:", "",
          *steps_study.table(runs, list(VARIANTS[1:]), budget=BUDGET, bytes_base="int4")]
    report.write_section(a.results_md, "\n".join(md).rstrip() + "\n", title=SECTION)
    steps_study.save(os.path.join(HERE, "results", "optimizer_state_steps.json"), cmd, runs)
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
