"""What each averaging hook holds beside the model: RSS and the handle's own count.

Each variant runs in a fresh process (world size 1, gloo, CPU): build the model and DDP,
read the resident set size (RSS), register, run two rounds (each after an optimizer
step), read RSS again and ``handle.memory_bytes()``. "extra" is the growth over the
model's own size (parameters only; the optimizer's state is excluded by measuring the
baseline after its first step). PyTorch's ``PeriodicModelAverager`` is measured the same
way, RSS only (it keeps nothing between rounds; its rounds allocate flat copies), as is
torchft's DiLoCo (``torchft_diloco``: its Manager and lighthouse on loopback, a sync
every step; it keeps a backup of the parameters and the outer optimizer's state), and
``none`` (the same steps, no averaging at all) is the control: its RSS growth is what
the training steps alone leave in the allocator.

    python benchmarks/bench_memory.py [--mb 80] [--out benchmarks/results/memory.json]
    python benchmarks/bench_memory.py --device cuda   # on a GPU: device memory too

Prints a Markdown table; RSS includes allocator slack, so read it beside the count. With
``--device cuda`` the model trains on the GPU (NCCL, world size 1) and the table adds the
peak extra device memory, ``torch.cuda.max_memory_allocated`` over two training steps
and rounds minus the same steps' peak without averaging, relative to the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

VARIANTS = ["none", "allreduce", "zero_copy", "fp16", "fp16_f32_residual", "fp16_no_ef", "bf16",
            "fp16_offload", "powersgd", "diloco", "diloco_fp16_offload", "overlap",
            "torch_periodic", "torchft_diloco"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one(variant: str, mb: float, device: str = "cpu") -> dict:
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_avg_hooks as dah

    torch.set_num_threads(1)
    cuda = device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    width = 1024
    layers = max(1, int(mb * 2**20 / (4 * width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)]).to(device)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=False)
        ddp(torch.randn(2, width, device=device)).sum().backward()
        opt.step()

    step()  # gradients exist from here on: not counted
    gc.collect()
    base = _rss()
    if cuda:  # the steps' own peak, without averaging
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        steps_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    h = dah.hooks
    handle, averager, peer = None, None, None
    if variant == "torchft_diloco":  # torchft's DiLoCo, its lighthouse on loopback
        from types import SimpleNamespace

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from harness.peers import TorchftDiLoCo
        args = SimpleNamespace(warmup=0, timeout=60, outer_lr=0.7, outer_momentum=0.9, period=1)
        peer = TorchftDiLoCo(model, opt, args, 1, lambda n: None)
    elif variant == "torch_periodic":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        averager = PeriodicModelAverager(period=1, warmup_steps=0)
    elif variant not in ("none", "torchft_diloco"):
        hook, state, options = {
            "allreduce": (h.allreduce_hook, None, {}),
            "fp16": (h.fp16_compress_hook, None, {}),
            "zero_copy": (h.allreduce_hook, None, {"zero_copy": True}),
            "fp16_f32_residual": (h.fp16_compress_hook, h.HalfDeltaState(residual_dtype=None), {}),
            "fp16_offload": (h.fp16_compress_hook, None, {"offload_state": True}),
            "diloco_fp16_offload": (h.outer_optimizer(h.fp16_compress_hook),
                                    h.OuterOptimizerState(h.HalfDeltaState()),
                                    {"offload_state": True}),
            "fp16_no_ef": (h.fp16_compress_hook, h.HalfDeltaState(error_feedback=False), {}),
            "bf16": (h.bf16_compress_hook, None, {}),
            "powersgd": (h.powersgd_hook, h.PowerSGDState(matrix_approximation_rank=4), {}),
            "diloco": (h.outer_optimizer(h.allreduce_hook), h.OuterOptimizerState(None), {}),
            "overlap": (h.allreduce_hook, None, {"overlap": True}),
        }[variant]
        handle = dah.register_averaging_hook(ddp, hook, state, **options)
    for _ in range(2):
        step()
        if handle is not None:
            handle.average()
        elif averager is not None:
            averager.average_parameters(model.parameters())
        elif peer is not None:
            assert peer.after_step(), "torchft's DiLoCo did not sync"
    gc.collect()
    out = {"variant": variant, "model_mb": model_bytes / 2**20,
           "rss_extra": (_rss() - base) / model_bytes}
    if cuda:
        torch.cuda.synchronize()
        out["device_peak_extra"] = (torch.cuda.max_memory_allocated() - steps_peak) / model_bytes
    if handle is not None:
        report = handle.memory_bytes()
        out["counted_extra"] = dah.memory.total(report) / model_bytes
        out["by_kind"] = {f"{k} ({dev})": n / model_bytes for k, d in report.items()
                          for dev, n in d.items()}
        handle.remove()
    if peer is not None:
        peer.close()
    dist.destroy_process_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=80.0, help="model size in MiB (float32)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(_one(a.one, a.mb, a.device)))
        return
    rows = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for v in a.variants.split(","):
        proc = subprocess.run([sys.executable, __file__, "--one", v, "--mb", str(a.mb),
                               "--device", a.device],
                              capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"{v} failed:\n{proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"model: {rows[0]['model_mb']:.0f} MiB of float32 parameters, world size 1, two rounds\n")
    cuda = a.device == "cuda"
    print("| variant | extra (RSS) | extra (handle's count) | by kind and device (handle's count) |"
          + (" peak extra device memory |" if cuda else ""))
    print("| --- | --- | --- | --- |" + (" --- |" if cuda else ""))
    for r in rows:
        kinds = ", ".join(f"{k} {x:.2f}x" for k, x in r.get("by_kind", {}).items())
        counted = f"{r['counted_extra']:.2f}x" if "counted_extra" in r else "n/a"
        peak = f" {r['device_peak_extra']:.3f}x |" if cuda else ""
        print(f"| {r['variant']} | {r['rss_extra']:.2f}x | {counted} | {kinds} |{peak}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
