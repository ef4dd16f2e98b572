"""Fused bucket ops: the extension vs the foreach tier vs the reference loop vs plain torch.

The parameter list is shaped like a GPT-2-style transformer with ~84M parameters
(d=768, 10 layers, 16k vocabulary; ~150 tensors). Each case is timed for every
variant with ``torch.utils.benchmark.Timer(...).blocked_autorange()`` (median), after
one correctness check that the extension, the foreach tier (``_fallback.foreach_*``)
and the reference loop (``_fallback.flatten`` ...) agree bit for bit.

GB/s counts the bytes the op must move (read + write, e.g. 6 B/element for
fp32 -> fp16), so variants of one case are comparable; ``copy_`` is one contiguous
fp32 -> fp32 copy of the same number of elements (8 B/element), the machine's
practical memory bandwidth for this access pattern.

The blockwise quantization ops of the int8/int4 hooks (block 128) compare the fused
kernels ("ext") with the plain-PyTorch reference of ``ddp_avg_hooks._quantize``
("reference"), after checking that they agree byte for byte: ``quantize`` reads the
delta and the residual and writes the codes, scales and new residual (13 B/element for
int8, 12.5 for int4); ``dequantize`` writes ``anchor - D`` (9 / 8.5 B/element); ``sum``
adds 4 ranks' pieces (per output element: 4 codes read, 4 B written).

The fp16/bf16 hooks' two ops count 14 B/element: ``feedback_cast`` reads the anchor, the
parameters and the bf16 residual and writes the fp16 delta and the residual;
``apply_delta_`` reads the anchor and the fp16 change and writes the parameters and the
anchor.

    python benchmarks/bench_ops.py                    # CPU, 1 and 2 threads
    python benchmarks/bench_ops.py --device cuda      # one GPU
    python benchmarks/bench_ops.py --scale 0.05       # a quick smaller run
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch
from torch.utils import benchmark

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ddp_avg_hooks import _ext, _fallback as F, _quantize as Qz, ops  # noqa: E402

FE = ops._FOREACH  # the foreach tier: _fallback.foreach_flatten, ...

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def transformer_params(device: str, scale: float = 1.0, seed: int = 0) -> list[torch.Tensor]:
    """~84M fp32 parameters in model.parameters() order of a GPT-2-like model."""
    d, layers, vocab, ctx = 768, 10, 16384, 1024
    vocab, ctx = max(1, int(vocab * scale)), max(1, int(ctx * scale))
    layers = max(1, round(layers * scale))
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,),
                   (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    shapes += [(d,), (d,)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).mul_(0.02).to(device) for s in shapes]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = {F32: torch.int32, F16: torch.int16, torch.bfloat16: torch.int16}[a.dtype]
    return a.dtype == b.dtype and torch.equal(a.view(it), b.view(it))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", default="1,2", help="CPU thread counts, comma separated")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the model (quick runs)")
    ap.add_argument("--min-run-time", type=float, default=1.0, help="seconds per measurement")
    args = ap.parse_args()

    C = _ext.load_extension()
    if C is None:
        sys.exit("the extension did not load (see the warning); nothing to compare")
    dev = args.device
    if dev.startswith("cuda") and not C.with_cuda():
        sys.exit("the extension was built without CUDA")

    ps = transformer_params(dev, args.scale)
    n = sum(p.numel() for p in ps)
    anchor32 = torch.cat([p.reshape(-1) for p in ps]) + 1e-3
    flat32 = torch.empty(n, dtype=F32, device=dev)
    flat16 = torch.empty(n, dtype=F16, device=dev)
    src32 = anchor32.clone()
    wire16 = flat16.clone().normal_()
    targets = [torch.empty_like(p) for p in ps]
    ws = 1.0 / 8

    # one correctness check per case before any timing: ext, foreach and reference agree
    def check(name, run, outs):
        got = []
        for impl in (C, FE, F):
            run(impl)
            got.append([o.clone() for o in outs])
        assert all(bits_equal(g, o) for r in got[1:] for g, o in zip(r, got[0])), \
            f"{name}: the implementations differ"

    check("flatten f32->f16", lambda m: m.flatten(ps, flat16, None), [flat16])
    check("flatten f32->f16 *s", lambda m: m.flatten(ps, flat16, ws), [flat16])
    check("delta f32->f16", lambda m: m.delta(anchor32, ps, flat16, ws), [flat16])
    check("delta f32->f32", lambda m: m.delta(anchor32, ps, flat32, ws), [flat32])
    check("unflatten f16->f32", lambda m: m.unflatten_(wire16, targets), targets)
    check("apply f32", lambda m: m.apply_(src32, targets, flat32), targets + [flat32])
    residual16 = (torch.randn(n, device=dev) * 1e-5).to(BF16)
    res_start = residual16.clone()

    def feedback(m):
        residual16.copy_(res_start)  # every tier starts from the same residual
        m.feedback_cast(anchor32, ps, residual16, flat16, ws)
    check("feedback f32->f16+bf16", feedback, [flat16, residual16])
    anchor_ad = anchor32.clone()

    def apply_delta(m):
        anchor_ad.copy_(anchor32)
        m.apply_delta_(anchor_ad, wire16, targets)
    check("apply_delta f16", apply_delta, targets + [anchor_ad])
    assert bits_equal(torch._utils._flatten_dense_tensors(ps).half(),
                      F.flatten(ps, flat16)), "flatten_dense().half() differs"

    g = dict(C=C, FE=FE, F=F, ps=ps, flat32=flat32, flat16=flat16, src32=src32,
             anchor32=anchor32, wire16=wire16, targets=targets, ws=ws, residual16=residual16,
             anchor_ad=anchor_ad,
             flatten_dense=torch._utils._flatten_dense_tensors)
    quant_cases = quantization_cases(C, g, n, dev)

    def tiers(call: str) -> list[tuple[str, str]]:
        return [(v, f"{m}.{call}")
                for v, m in (("ext", "C"), ("foreach", "FE"), ("reference", "F"))]

    # (case, bytes moved per element, [(variant, stmt)])
    cases = [
        ("flatten f32->f16", 6, tiers("flatten(ps, flat16, None)") + [
            ("flatten_dense().half()", "flatten_dense(ps).half()"),
            ("copy_ flat f32->f16", "flat16.copy_(src32)"),
        ]),
        ("flatten f32->f16 *s", 6, tiers("flatten(ps, flat16, ws)")),
        ("flatten f32->f32", 8, tiers("flatten(ps, flat32, None)") + [
            ("flatten_dense()", "flatten_dense(ps)"),
        ]),
        ("delta f32,f32->f16 *s", 10, tiers("delta(anchor32, ps, flat16, ws)")),
        ("delta f32,f32->f32 *s", 12, tiers("delta(anchor32, ps, flat32, ws)")),
        ("unflatten f16->f32", 6, tiers("unflatten_(wire16, targets)")),
        ("apply f32->params+anchor", 12, tiers("apply_(src32, targets, flat32)")),
        # the half hooks' two passes: error feedback into fp16 with a bf16 residual, and
        # the averaged fp16 change written into the parameters and the anchor
        ("feedback f32->f16+bf16 *s", 14,
         tiers("feedback_cast(anchor32, ps, residual16, flat16, ws)")),
        ("apply_delta f16->params+anchor", 14, tiers("apply_delta_(anchor_ad, wire16, targets)")),
    ] + quant_cases

    if dev.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(dev))
        thread_counts = [torch.get_num_threads()]
    else:
        name = f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical cpus"
        thread_counts = [int(t) for t in args.threads.split(",")]
    threads_shown = args.threads if not dev.startswith('cuda') else '-'
    print(f"torch {torch.__version__} | device {dev} ({name}) | threads {threads_shown} "
          f"| params {n / 1e6:.1f}M in {len(ps)} tensors | median of blocked_autorange")

    def time_stmt(stmt: str, threads: int) -> float:
        t = benchmark.Timer(stmt=stmt, globals=g, num_threads=threads)
        return t.blocked_autorange(min_run_time=args.min_run_time).median

    for threads in thread_counts:
        copy_s = time_stmt("flat32.copy_(src32)", threads)
        copy_gbs = 8 * n / copy_s / 1e9
        print(f"threads={threads}  copy_ f32->f32 (flat, {n / 1e6:.1f}M)  {copy_s * 1e3:8.2f} ms  "
              f"{copy_gbs:6.2f} GB/s")
        for case, bpe, variants in cases:
            res = {v: time_stmt(stmt, threads) for v, stmt in variants}
            for v, s in res.items():
                gbs = bpe * n / s / 1e9
                print(f"threads={threads}  {case:26s} {v:24s} {s * 1e3:8.2f} ms  {gbs:6.2f} GB/s  "
                      f"{gbs / copy_gbs:5.2f}x copy_ BW")
            ext = res["ext"]
            others = "  ".join(f"{v}/ext {s / ext:5.2f}x" for v, s in res.items() if v != "ext")
            print(f"threads={threads}  {case:26s} -> {others}")


def quantization_cases(C, g: dict, n: int, dev: str) -> list:
    """The int8/int4 hooks' fused ops vs the reference, checked first; adds their tensors
    to ``g``."""
    g.update(C=C, Qz=Qz)
    delta = torch.randn(n, device=dev).mul_(1e-3)
    cases = []
    for bits in (8, 4):
        one = ops.QuantLayout.for_bucket(n, 1, 128, bits)
        four = ops.QuantLayout.for_bucket(n, 4, 128, bits)
        k = f"q{bits}"
        g.update({f"{k}_L": one, f"{k}_L4": four, f"{k}_x": delta, f"{k}_e": delta.mul(1e-3),
                  f"{k}_pk": torch.zeros(one.total_bytes, dtype=torch.uint8, device=dev),
                  f"{k}_pk4": torch.zeros(four.total_bytes, dtype=torch.uint8, device=dev),
                  f"{k}_base": delta.add(1.0), f"{k}_out": torch.empty(n, device=dev),
                  f"{k}_sum": torch.empty(four.piece_elems, device=dev)})
        L = f"{k}_L.bits, {k}_L.block_size, {k}_L.pieces, {k}_L.piece_elems, {k}_L.piece_bytes"
        L4 = L.replace(f"{k}_L.", f"{k}_L4.")
        quant = (f"C.quantize_blocks({k}_x, {k}_e, {k}_pk, {k}_e, {L})",
                 f"Qz.quantize_blocks({k}_x, {k}_pk, {k}_L, {k}_e, {k}_e)")
        deq = (f"C.dequantize_blocks({k}_pk, {k}_base, {k}_out, {L}, False)",
               f"Qz.dequantize_blocks({k}_pk, {k}_L, {k}_out, base={k}_base)")
        summed = (f"C.quantize_blocks({k}_x, None, {k}_pk4, None, {L4}); "
                  f"C.dequantize_blocks({k}_pk4, None, {k}_sum, {L4}, True)",
                  f"Qz.dequantize_blocks({k}_pk4, {k}_L4, {k}_sum, sum_pieces=True)")
        for name, (ext, ref), outs in (("quantize", quant, (f"{k}_pk", f"{k}_e")),
                                       ("dequantize", deq, (f"{k}_out",)),
                                       ("sum", summed, (f"{k}_sum",))):
            got = []
            for stmt in (ext, ref):
                g[f"{k}_e"].copy_(delta.mul(1e-3))
                exec(stmt, g)
                got.append([g[o].clone() for o in outs])
            assert all(torch.equal(a, b) for a, b in zip(*got)), \
                f"{name} int{bits}: ext != reference"
        ext_sum = summed[0].split("; ")[1]  # time the dequantize only (the payload is filled)
        b = bits / 8
        cases += [
            (f"quantize f32+e -> int{bits}", 12 + b + 4 / 128,
             [("ext", quant[0]), ("reference", quant[1])]),
            (f"dequantize int{bits} -> a-D", 8 + b, [("ext", deq[0]), ("reference", deq[1])]),
            (f"sum 4 pieces int{bits}", (4 * b + 4) / 4,
             [("ext", ext_sum), ("reference", summed[1])]),
        ]
    return cases


if __name__ == "__main__":
    main()
