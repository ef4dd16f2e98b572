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

from harness import steps_study

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
    return steps_study.main(
        __doc__, "bench_period_steps.py", argv=argv, configs=CONFIGS,
        bytes_base="int4_overlap, period 8",
        section="## Fewer steps to the target: where the period costs steps",
        json_name="period_steps.json",
        describe="`allreduce`: exact blocking rounds; `int4_overlap`: 4-bit rounds "
                 "overlapped with training, with the period changing at a step by "
                 "`schedules.PostLocalPeriod`.")


if __name__ == "__main__":
    raise SystemExit(main())
