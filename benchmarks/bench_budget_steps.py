"""Steps to DDP's loss after longer training: does the period's cost in steps shrink?

The steps target compares each method with DDP after DDP's 200-step budget, early in
training, while the loss still falls fast. This study trains the configurations of the
seed study (``bench_seed_steps.py``: DDP, exact period-8 averaging and our best
configuration) for 1000 steps at a constant learning rate on seeds 0-7, and reads from
the same runs each method's steps to DDP's loss after 200, 400 and 800 steps, over DDP's.
The first 300 steps of each run are those of the seed study's runs of the same seed.

Outputs ``benchmarks/results/budget_steps.json`` and the section "Steps to the target
after longer training" of ``benchmarks/RESULTS.md``. About 8 minutes a seed on 2 cores.

    python benchmarks/bench_budget_steps.py               # seeds 0-7
    python benchmarks/bench_budget_steps.py --reuse       # only the runs not made yet
"""
from __future__ import annotations

from bench_seed_steps import METHODS, OURS, PERIOD
from harness import report, steps_study

STEPS = 1000
BUDGETS = (200, 400, 800)
CONFIGS = {"ddp": ["--hook", "ddp"], **METHODS}


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_budget_steps.py", argv=argv, configs=CONFIGS, bytes_base="allreduce",
        within=report.STEPS_TARGET, seeds=",".join(map(str, range(8))),
        steps=STEPS, budget=BUDGETS[0], later_budgets=BUDGETS[1:],
        section="## Steps to the target after longer training",
        json_name="budget_steps.json",
        describe=f"Every run {STEPS} steps at a constant lr after the warm-up; the targets "
                 f"are DDP's loss after {', '.join(map(str, BUDGETS))} steps of its run. "
                 f"Period {PERIOD}; `allreduce`: exact blocking rounds; `{OURS}`: 4-bit rounds "
                 "of 4 interleaved fragments, overlapped, each applied at the step after its "
                 "launch.")


if __name__ == "__main__":
    raise SystemExit(main())
