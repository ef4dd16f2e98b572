"""What an overlapped round's write-back and its profiler ranges cost on the training thread.

An overlapped round ends with ``DeviceStorage.write_with_progress``: ``params += values -
launch`` (the progress made since the launch kept) and ``anchor = values``. This times the
library's own call on the largest fragment of the training benchmark's model (its
parameters split as ``register_averaging_hook(..., fragments=4)`` splits them), beside
two candidate reductions: the subtraction in one pass (``torch.sub(values, launch,
out=launch)`` for ``launch.neg_().add_(values)``, bit-identical), and no
``record_function`` range (a round opens three).
A bit-for-bit check of the one-pass form runs first. One process, one thread; median of
``torch.utils.benchmark.Timer.blocked_autorange``.

    python benchmarks/bench_write_back.py [--min-run-time 1.0] [--fragments 4]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.autograd.profiler import record_function
from torch.utils.benchmark import Timer

from ddp_avg_hooks import ops
from ddp_avg_hooks.planner import split_fragments
from ddp_avg_hooks.storage import DeviceStorage

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness"))
from train import PRESETS, CharTransformer  # noqa: E402  (the training benchmark's model)


@torch.no_grad()
def one_pass_write(storage: DeviceStorage, values: torch.Tensor, launch: torch.Tensor) -> None:
    """``write_with_progress(values, launch, None)`` with the subtraction in one pass."""
    correction = torch.sub(values, launch, out=launch)
    torch._foreach_add_(storage.params, ops.split_like(correction, storage.params))
    storage.anchor.copy_(values)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-run-time", type=float, default=1.0)
    ap.add_argument("--fragments", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    shape = PRESETS["bench"]
    model = CharTransformer(shape["d_model"], shape["n_layers"], shape["n_heads"],
                            shape["context"])
    parts = split_fragments([p.detach() for p in model.parameters()], args.fragments)
    params = max(parts, key=lambda ps: sum(p.numel() for p in ps))
    storage = DeviceStorage(params)
    storage.keep_anchor()
    numel = storage.numel
    values = torch.randn(numel)
    launch = torch.empty(numel)

    # bit-for-bit: the one-pass form writes what the library writes
    start = [p.clone() for p in params]
    launch.copy_(torch.randn(numel))
    saved = launch.clone()
    storage.write_with_progress(values, launch, None)
    ours = [p.clone() for p in params]
    for p, s in zip(params, start):
        p.copy_(s)
    one_pass_write(storage, values, saved.clone())
    assert all(torch.equal(a, b) for a, b in zip(ours, params)), "one-pass form differs"

    env = dict(storage=storage, values=values, launch=launch, saved=saved, rf=record_function,
               one_pass_write=one_pass_write)
    rows = [
        ("write_with_progress (library)",
         "launch.copy_(saved); storage.write_with_progress(values, launch, None)"),
        ("write_with_progress, one-pass sub",
         "launch.copy_(saved); one_pass_write(storage, values, launch)"),
        ("launch.copy_ alone (subtract from both)", "launch.copy_(saved)"),
        ("record_function range, no profiler", "with rf('ddp_avg_hooks::round::launch'): pass"),
    ]
    print(f"torch {torch.__version__} | threads 1 | largest of {args.fragments} fragments: "
          f"{numel} fp32 elements in {len(params)} tensors | median of blocked_autorange")
    for label, stmt in rows:
        m = Timer(stmt, globals=env).blocked_autorange(min_run_time=args.min_run_time)
        print(f"{label:42s} {m.median * 1e6:9.1f} us")


if __name__ == "__main__":
    main()
