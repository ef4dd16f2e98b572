"""PowerSGD's per-bucket memory: where each parameter sits, the factors, error feedback.

``Layout`` decides which parameters of a bucket are compressed (matrices worth it) and
where their factors go; ``BucketMemory`` holds one bucket's buffers, and
``save_bucket`` / ``load_bucket`` are its checkpoint entry. Used by ``powersgd.py``.
"""

from __future__ import annotations

import torch

from ..bucket import ParamBucket


class Layout:
    """Where each parameter of a bucket sits, and which are compressed."""

    __slots__ = ("matrices", "exact_runs", "p_numel", "q_numel", "exact_numel")

    def __init__(self, bucket: ParamBucket, rank: int, min_compression_rate: float) -> None:
        # (off, n, m, r, p_off, q_off) per compressed matrix
        self.matrices: list[tuple[int, int, int, int, int, int]] = []
        self.exact_runs: list[tuple[int, int]] = []  # (off, length), merged when adjacent
        runs: list[list[int]] = []
        off = p_off = q_off = 0
        for p in bucket.parameters():
            numel = p.numel()
            if p.dim() >= 2 and numel > 0:
                n = p.shape[0]
                m = numel // n
                r = min(rank, n, m)
                if r * (n + m) * min_compression_rate < n * m:
                    self.matrices.append((off, n, m, r, p_off, q_off))
                    p_off += n * r
                    q_off += m * r
                    off += numel
                    continue
            if numel:
                if runs and runs[-1][0] + runs[-1][1] == off:
                    runs[-1][1] += numel
                else:
                    runs.append([off, numel])
            off += numel
        self.exact_runs = [(o, n) for o, n in runs]
        self.exact_numel = sum(n for _, n in runs)
        self.p_numel = p_off + self.exact_numel  # P factors, then the exact tensors
        self.q_numel = q_off


class BucketMemory:
    """Per-bucket buffers: factors, warm-start Q, its seed draw, error feedback."""

    __slots__ = ("numel", "layout", "p", "q", "q_local", "q_init", "residual")

    def __init__(self, state, bucket: ParamBucket) -> None:
        self.numel = bucket.numel()
        dtype = torch.float64 if bucket.dtype == torch.float64 else torch.float32
        self.layout = Layout(bucket, state.matrix_approximation_rank, state.min_compression_rate)
        dev = bucket.device
        self.p = torch.empty(self.layout.p_numel, dtype=dtype, device=dev)
        self.q_init = state.draw_q(self.layout.q_numel, bucket.index(), None, dtype, dev)
        self.q = self.q_init.clone()
        self.q_local = torch.empty_like(self.q) if state.use_error_feedback else None
        ef = state.use_error_feedback
        self.residual = torch.zeros(bucket.numel(), dtype=dtype, device=dev) if ef else None

    def memory_tensors(self):
        yield from (("hook_state", t) for t in (self.p, self.q, self.q_init))
        yield "scratch", self.q_local
        yield "residuals", self.residual


def save_bucket(mem: BucketMemory) -> dict:
    entry = {"q": mem.q.clone()}
    if mem.residual is not None:
        entry["residual"] = mem.residual.clone()
    return entry


def load_bucket(mem: BucketMemory, entry: dict) -> None:
    for name in ("q", "residual"):
        mine, saved = getattr(mem, name), entry.get(name)
        if mine is None or saved is None:
            continue
        if mine.numel() != saved.numel():
            raise ValueError(f"{name} has {mine.numel()} elements here and {saved.numel()} "
                             "in the checkpoint")
        mine.copy_(saved)
