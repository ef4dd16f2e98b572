"""Time the int8/int4 quantize op of the hooks on one thread: the C++ extension
(``ops.quantize_blocks``) and the PyTorch reference (``_quantize.quantize_blocks``), on N
fp32 values plus a residual, block 128; medians, as one JSON line.

Run it in two checkouts, taking turns, to compare a change to the kernels with the code
before it (each checkout builds its own extension)::

    OMP_NUM_THREADS=1 python benchmarks/time_quantize.py 21000000 15
"""

import json
import sys
import time

import torch

from ddp_avg_hooks import _quantize as Qz, ops


def main(n: int, reps: int) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(n, generator=g) * 0.02, torch.randn(n, generator=g) * 1e-4
    out = {"backend": ops.backend()}
    for bits in (8, 4):
        layout = ops.QuantLayout.for_bucket(n, 1, 128, bits)
        packed, r = torch.zeros(layout.total_bytes, dtype=torch.uint8), torch.empty(n)
        for name, fn, k in (
                ("ext", lambda: ops.quantize_blocks(x, packed, layout, residual=e,
                                                    residual_out=r), reps),
                ("reference", lambda: Qz.quantize_blocks(x, packed, layout, e, r),
                 max(1, reps // 4))):
            fn()
            times = []
            for _ in range(k):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            out[f"int{bits} {name} ms"] = round(sorted(times)[len(times) // 2] * 1e3, 2)
    return out


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))))
