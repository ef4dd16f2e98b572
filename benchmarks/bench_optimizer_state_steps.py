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

from harness import steps_study

PERIOD = 8
VARIANTS = ("ddp", "int4", "int4_optstate", "int4_streaming", "int4_streaming_optstate")


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_optimizer_state_steps.py", argv=argv, bytes_base="int4",
        section="## Fewer steps to the target: averaging the optimizer's state",
        json_name="optimizer_state_steps.json",
        configs={name: ["--period", str(PERIOD), "--hook", name] for name in VARIANTS},
        describe=f"Period {PERIOD} (`*_streaming*`: 4 fragments, overlapped). `*_optstate`: "
                 "the same with `optimizer_state=\"average\"` (AdamW's two moments averaged "
                 "exactly, in fp32, at each round; with fragments, at fragment 0's).")


if __name__ == "__main__":
    raise SystemExit(main())
