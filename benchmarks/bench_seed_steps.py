"""Steps to DDP's loss over 10 seeds: where the two seeds of the headline tables sit.

The slow-link tables train seeds 0 and 1. This study trains DDP, exact period-8
averaging (``allreduce``, the rule of PyTorch's ``PeriodicModelAverager``) and the best
configuration of those tables, 4-bit rounds of 4 interleaved fragments overlapped with
training, once per seed over 10 seeds on loopback (``harness/steps_study.py``), and
reports each seed's steps to DDP's loss over DDP's, their mean and median and on how many
seeds the ratio is within the 1.10x target. Beside them, DDP itself from the same initial
model on another order of the training batches (``--data-seed-offset``): how far a seed's
figure moves when nothing but the data order changes, the noise of the measure. The
overlapped configuration applies every
round at the step after its launch (``overlap_steps=1``), so that each of its figures
repeats exactly, as the blocking rounds' do. The default rule applies a round at the
first step that finds it complete, which depends on timing, so its figures move between
runs of a seed.

Outputs ``benchmarks/results/seed_steps.json`` and the section "Steps to the target over
10 seeds" of ``benchmarks/RESULTS.md``. About 2 minutes a seed on 2 cores.

    python benchmarks/bench_seed_steps.py --seeds 0,1,2,3,4,5,6,7,8,9
"""
from __future__ import annotations

from harness import report, steps_study

PERIOD = 8
CONFIGS = {
    "ddp": ["--hook", "ddp"],
    "ddp_other_data_order": ["--hook", "ddp", "--data-seed-offset", "100"],
    "allreduce": ["--hook", "allreduce", "--period", str(PERIOD)],
    "int4_streaming_interleaved_next_step": [
        "--hook", "int4_streaming_interleaved_next_step", "--period", str(PERIOD)],
}


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_seed_steps.py", argv=argv, configs=CONFIGS,
        bytes_base="allreduce", within=report.STEPS_TARGET, seeds=",".join(map(str, range(10))),
        section="## Steps to the target over 10 seeds",
        json_name="seed_steps.json",
        describe=f"`ddp_other_data_order`: DDP from the same initial model on another order "
                 "of the training batches (`--data-seed-offset 100`). "
                 f"Period {PERIOD}; `allreduce`: exact blocking rounds; "
                 "`int4_streaming_interleaved_next_step`: 4-bit rounds of 4 interleaved "
                 "fragments, overlapped, each applied at the step after its launch.")


if __name__ == "__main__":
    raise SystemExit(main())
