"""What compressed rounds cost at equal steps, against PyTorch's PeriodicModelAverager.

The compressed hooks send a round's change in 16, 8 or 4 bits (with error feedback)
instead of the parameters in 32. Does that cost loss at equal steps, or steps to DDP's
loss? Each configuration trains once per seed on loopback (``harness/steps_study.py``;
loss at a step does not depend on the link): PyTorch's ``post_localSGD_hook`` with
``PeriodicModelAverager`` (``torch_localsgd``) is the reference, our exact ``allreduce``
rounds run the same rule, then ``fp16``, ``int8`` and ``int4`` (blocking rounds),
``int8_streaming`` and ``int4_streaming`` (4 fragments, overlapped), all at period 8 and
lr 1e-3; ``diloco`` and ``diloco_int4`` (outer Nesterov SGD lr 0.7, momentum 0.9, period
32, inner lr 3e-4, the slow-link runs' DiLoCo setting) against each other.

Outputs ``benchmarks/results/compression_steps.json`` and the section "Compressed rounds
at equal steps: against PeriodicModelAverager" of ``benchmarks/RESULTS.md``. About 4
minutes a seed on 2 cores.

    python benchmarks/bench_compression_steps.py --seeds 0,1,2,3,4
"""
from __future__ import annotations

from harness import steps_study

PERIOD = 8
LOCAL_SGD = ("torch_localsgd", "allreduce", "fp16", "int8", "int4", "int8_streaming",
             "int4_streaming")
DILOCO = ["--period", "32", "--lr", "3e-4", "--outer-lr", "0.7", "--outer-momentum", "0.9"]
CONFIGS = {"ddp": ["--hook", "ddp"],
           **{name: ["--hook", name, "--period", str(PERIOD)] for name in LOCAL_SGD},
           "diloco": ["--hook", "diloco", *DILOCO],
           "diloco_int4": ["--hook", "diloco_int4", *DILOCO]}


def main(argv=None) -> int:
    return steps_study.main(
        __doc__, "bench_compression_steps.py", argv=argv, configs=CONFIGS,
        bytes_base="torch_localsgd", loss_base="torch_localsgd",
        section="## Compressed rounds at equal steps: against PeriodicModelAverager",
        json_name="compression_steps.json",
        describe=f"Period {PERIOD}, no warm-up of plain DDP steps; `*_streaming`: 4 "
                 "fragments, overlapped. `diloco`, `diloco_int4`: period 32, inner lr 3e-4, "
                 "outer Nesterov SGD lr 0.7, momentum 0.9 (exact and 4-bit inner "
                 "averages); they reach DDP's loss after the 300 steps trained, if at all.")


if __name__ == "__main__":
    raise SystemExit(main())
