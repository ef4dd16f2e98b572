"""Why PowerSGD on parameter deltas loses loss: the spectrum of an 8-step delta.

Trains the ``bench`` preset (the model of ``bench_train.py``) in one process with AdamW,
and at every ``--period`` steps takes the change of each weight matrix since the last
round (what ``powersgd_hook`` compresses) and, for comparison, one step's gradient (what
PyTorch's PowerSGD gradient hook compresses). For each it reports the share of the
squared Frobenius norm that the best rank-r approximation keeps (``sum of the r largest
squared singular values / total``): PowerSGD at rank r cannot do better than that per
round; what it misses waits in the error-feedback residual.

    python benchmarks/study_powersgd.py            # ~1 min on 2 cores
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F

from harness.train import PRESETS, CharTransformer, get_batch, load_corpus, split

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS = (1, 2, 4, 8, 16, 32)


def energy_kept(m: torch.Tensor, ranks=RANKS) -> dict[int, float]:
    s2 = torch.linalg.svdvals(m.double()) ** 2
    total = float(s2.sum()) or 1.0
    return {r: float(s2[:r].sum()) / total for r in ranks}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--period", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default=os.path.join(HERE, "results", "powersgd_spectrum.json"))
    a = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = PRESETS["bench"]
    data, _ = split(load_corpus(), 0.1)
    model = CharTransformer(cfg["d_model"], cfg["n_layers"], cfg["n_heads"], cfg["context"])
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    matrices = [(n, q) for n, q in model.named_parameters() if q.dim() == 2 and min(q.shape) > 32]
    anchor = {n: q.detach().clone() for n, q in matrices}
    delta_kept, grad_kept = [], []
    for step in range(a.steps):
        x, y = get_batch(data, cfg["batch_size"], cfg["context"], gen)
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if step % a.period == 0:
            grad_kept += [energy_kept(q.grad) for _, q in matrices]
        opt.step()
        if (step + 1) % a.period == 0:
            for n, q in matrices:
                delta_kept.append(energy_kept(anchor[n] - q.detach()))
                anchor[n] = q.detach().clone()
    summary = {kind: {r: round(statistics.fmean(k[r] for k in kept), 4) for r in RANKS}
               for kind, kept in (("delta", delta_kept), ("gradient", grad_kept))}
    shapes = sorted({tuple(q.shape) for _, q in matrices})
    lines = [f"Energy kept by the best rank-r approximation (mean over {len(matrices)} weight "
             f"matrices of shapes {shapes}, {a.steps} AdamW steps at lr {a.lr}, period {a.period})",
             "", "| r | " + " | ".join(str(r) for r in RANKS) + " |",
             "|---" * (len(RANKS) + 1) + "|"]
    for kind in summary:
        lines.append(f"| {a.period}-step delta |" if kind == "delta" else "| one gradient |")
        lines[-1] += " " + " | ".join(f"{summary[kind][r]:.3f}" for r in RANKS) + " |"
    print("\n".join(lines))
    with open(a.out, "w") as f:
        json.dump(dict(command="python benchmarks/study_powersgd.py", args=vars(a),
                       summary=summary), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
