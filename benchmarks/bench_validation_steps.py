"""Steps to DDP's loss validated on 8 times more held-out text.

Every training run validates on the same 8 fixed batches of 8 windows (4,096 tokens of
the held-out split). Is a seed's gap to DDP in steps a property of training, or of that
small sample? Exact period-8 averaging (``allreduce``, the rule of PyTorch's
``PeriodicModelAverager``) and ``int4`` train against DDP once per seed on loopback
(``harness/steps_study.py``), validated on 64 batches (32,768 tokens, the same 8 first);
compare with the same configurations on 8 batches in "Compressed rounds at equal steps:
against PeriodicModelAverager". Blocking rounds repeat a run exactly, so the two read
the same training runs through two validation sets.

Outputs ``benchmarks/results/validation_steps.json`` and the section "Steps to the
target: a validation set 8 times larger" of ``benchmarks/RESULTS.md``. About 1.5 minutes
a seed on 2 cores.

    python benchmarks/bench_validation_steps.py --seeds 0,1,2,3,4
"""
from __future__ import annotations

from harness import steps_study

EVAL_BATCHES = 64
CONFIGS = {name: ["--hook", name, "--eval-batches", str(EVAL_BATCHES),
                  *([] if name == "ddp" else ["--period", "8"])]
           for name in ("ddp", "allreduce", "int4")}


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_validation_steps.py", argv=argv, configs=CONFIGS,
        bytes_base="allreduce", loss_base="allreduce",
        section="## Steps to the target: a validation set 8 times larger",
        json_name="validation_steps.json",
        describe=f"Period 8, blocking rounds; every run validated on {EVAL_BATCHES} "
                 f"batches of 8 windows ({EVAL_BATCHES * 8 * 64:,} tokens) instead of 8.")


if __name__ == "__main__":
    raise SystemExit(main())
