"""Steps to DDP's loss with fragments of neighbouring layers or of layers from all over.

``fragments=4`` deals the parameters into 4 fragments that take turns, one round every
2 steps at period 8. ``fragment_layout="contiguous"`` (the default) cuts them in
parameter order, so a fragment is a block of neighbouring layers; ``"interleaved"`` deals
the largest first to the least-filled fragment, so every fragment takes layers from all
over the model. The overlapped int4 and int8 fragment hooks train with each layout
against DDP once per seed on loopback (``harness/steps_study.py``); the int4 pair trains
twice, since an overlapped run lands its rounds at other steps from run to run and moves
with it.

Outputs ``benchmarks/results/fragment_steps.json`` and the section "Fewer steps to the
target: fragments of layers from all over the model" of ``benchmarks/RESULTS.md``.
About 2.5 minutes a seed on 2 cores.

    python benchmarks/bench_fragment_steps.py --seeds 0,1,2,3,4
"""
from __future__ import annotations

from harness import steps_study

PERIOD = ["--period", "8", "--fragments", "4"]
CONFIGS = {"ddp": ["--hook", "ddp"]}
for hook, runs in (("int4_streaming", 2), ("int8_streaming", 1)):
    for run in range(1, runs + 1):
        for variant in (hook, hook + "_interleaved"):
            CONFIGS[variant + (f", run {run}" if runs > 1 else "")] = ["--hook", variant, *PERIOD]


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_fragment_steps.py", argv=argv, configs=CONFIGS,
        bytes_base="int4_streaming, run 1", loss_base="int4_streaming, run 1",
        section="## Fewer steps to the target: fragments of layers from all over the model",
        json_name="fragment_steps.json",
        describe="Period 8 in 4 fragments, rounds overlapped with training; `*_interleaved`: "
                 "`fragment_layout=\"interleaved\"`, the others the default `\"contiguous\"`.")


if __name__ == "__main__":
    raise SystemExit(main())
