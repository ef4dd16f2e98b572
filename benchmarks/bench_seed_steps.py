"""Steps to DDP's loss over 40 seeds: where the two seeds of the headline tables sit.

The slow-link tables train seeds 0 and 1. This study trains DDP, exact period-8
averaging (``allreduce``, the rule of PyTorch's ``PeriodicModelAverager``) and the best
configuration of those tables, 4-bit rounds of 4 interleaved fragments overlapped with
training, over 40 seeds on loopback (``harness/steps_study.py``), and
reports each seed's steps to DDP's loss over DDP's, their mean and median and on how many
seeds the ratio is within the 1.10x target. Each seed trains twice, from the same
initial model on two orders of the training batches (``--data-seed-offset``), each method
against DDP on the same order: two samples a seed, pooled in a line of their own. DDP on
the second order against DDP on the first shows how far the reference itself moves when
nothing but the data order changes. The overlapped configuration applies every
round at the step after its launch (``overlap_steps=1``), so that each of its figures
repeats exactly, as the blocking rounds' do. The default rule applies a round at the
first step that finds it complete, which depends on timing, so its figures move between
runs of a seed.

Outputs ``benchmarks/results/seed_steps.json`` and the section "Steps to the target over
many seeds" of ``benchmarks/RESULTS.md``. About 3 minutes a seed on 2 cores; ``--reuse`` reads
the runs already made by the same arguments.

    python benchmarks/bench_seed_steps.py                 # seeds 0-39
    python benchmarks/bench_seed_steps.py --reuse         # only the runs not made yet
"""
from __future__ import annotations

from harness import report, steps_study

PERIOD = 8
OURS = "int4_streaming_interleaved_next_step"
METHODS = {
    "allreduce": ["--hook", "allreduce", "--period", str(PERIOD)],
    OURS: ["--hook", OURS, "--period", str(PERIOD)],
}
OTHER_ORDER = ["--data-seed-offset", "100"]
CONFIGS = {
    "ddp": ["--hook", "ddp"],
    "ddp_other_data_order": ["--hook", "ddp", *OTHER_ORDER],
    **METHODS,
    **{f"{name}_other_data_order": [*flags, *OTHER_ORDER] for name, flags in METHODS.items()},
}
# each method on the other data order against DDP on that order; DDP on the other order
# against DDP on the first (how far the reference itself moves)
REFERENCES = {f"{name}_other_data_order": "ddp_other_data_order" for name in METHODS}
BYTES_BASE = {name: ("allreduce_other_data_order" if name in REFERENCES else "allreduce")
              for name in CONFIGS if name != "ddp"}
POOLS = {f"`{name}`, both data orders": {name: "ddp",
                                        f"{name}_other_data_order": "ddp_other_data_order"}
         for name in METHODS}


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_seed_steps.py", argv=argv, configs=CONFIGS, references=REFERENCES,
        bytes_base=BYTES_BASE, pools=POOLS, within=report.STEPS_TARGET,
        seeds=",".join(map(str, range(40))),
        section="## Steps to the target over many seeds",
        json_name="seed_steps.json",
        describe="Each method trains twice a seed, from the same initial model on two orders "
                 "of the training batches (`*_other_data_order`: `--data-seed-offset 100`), "
                 "each against DDP on the same order; `ddp_other_data_order` against DDP on "
                 f"the first order. Period {PERIOD}; `allreduce`: exact blocking rounds; "
                 f"`{OURS}`: 4-bit rounds of 4 interleaved "
                 "fragments, overlapped, each applied at the step after its launch.")


if __name__ == "__main__":
    raise SystemExit(main())
