"""Steps to DDP's loss when every method warms its learning rate up over 60 steps, not 20.

The other loopback studies warm the lr up over 20 steps, for DDP and local SGD alike. The
warm-up moves DDP's own loss at its 200-step budget, and so the target every other
method is measured against. This study runs DDP, exact averaging and the 4-bit hooks at
period 8 with a 60-step warm-up for all of them (``harness/steps_study.py``: loopback,
one run per configuration and seed); compare with the 20-step figures of "Fewer steps to
the target: averaging the optimizer's state" and "... where the period costs steps".

Outputs ``benchmarks/results/warmup_steps.json`` and the section "Fewer steps to the
target: a 60-step learning-rate warm-up for every method" of ``benchmarks/RESULTS.md``.
About 3 minutes a seed on 2 cores.

    python benchmarks/bench_warmup_steps.py --seeds 0,1,2,3,4
"""
from __future__ import annotations

from harness import steps_study

WARMUP, PERIOD = 60, 8
CONFIGS = {name: ["--period", str(PERIOD), "--hook", name]
           for name in ("ddp", "allreduce", "int4", "int4_streaming")}


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_warmup_steps.py", argv=argv, configs=CONFIGS, bytes_base="int4",
        lr_warmup=WARMUP,
        section="## Fewer steps to the target: a 60-step learning-rate warm-up for every method",
        json_name="warmup_steps.json",
        describe=f"The warm-up is {WARMUP} steps for every configuration, DDP included. "
                 f"Period {PERIOD}; `allreduce`: exact blocking rounds; `int4`: blocking "
                 "4-bit rounds; `int4_streaming`: 4 fragments, overlapped.")


if __name__ == "__main__":
    raise SystemExit(main())
