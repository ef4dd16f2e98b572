"""The learning-rate benchmark's table: steps to each DDP lr's loss, and each method at its
best lr (hand-made validation curves, no training here)."""
from __future__ import annotations

import bench_lr_steps


def _run(*evals):
    return {"evals": [{"step": s, "train_s": s / 10, "val_loss": v} for s, v in evals]}


def test_steps_to_each_ddp_lrs_loss_and_the_best_lr_of_each_method():
    runs = {
        ("ddp", 1e-3): _run((180, 2.6), (200, 2.5), (220, 2.4)),  # target 2.5
        ("ddp", 7e-4): _run((180, 2.7), (200, 2.6), (220, 2.45), (240, 2.3)),  # target 2.6
        ("int4_streaming", 1e-3): _run((200, 2.7), (220, 2.55), (240, 2.45)),
        ("int4_streaming", 7e-4): _run((180, 2.7), (200, 2.6), (220, 2.52), (240, 2.42)),
        ("int4_streaming", 1.5e-3): _run((200, 2.9), (400, 2.7)),
    }
    lines = bench_lr_steps._seed_lines(0, runs)
    rows = [ln for ln in lines if ln.startswith("| ddp |") or ln.startswith("| int4")]
    assert rows == [
        # 2.5 reached at 200; 2.6 first at or below at the first validation, step 180
        "| ddp | 0.001 | 2.5000 | 200 (1.00x) | 180 (0.90x) |",
        # 2.5: 200 + 20 * (2.6 - 2.5) / (2.6 - 2.45) = 213.3
        "| ddp | 0.0007 | 2.6000 | 213 (1.07x) | 200 (1.00x) |",
        # 2.5: 220 + 20 * 0.05 / 0.10 = 230; 2.6: 200 + 20 * 0.1 / 0.15 = 213.3
        "| int4_streaming | 0.001 | 2.7000 | 230 (1.15x) | 213 (1.07x) |",
        # 2.5: 220 + 20 * 0.02 / 0.10 = 224
        "| int4_streaming | 0.0007 | 2.6000 | 224 (1.12x) | 200 (1.00x) |",
        "| int4_streaming | 0.0015 | 2.9000 | not reached | not reached |",
    ]
    # best of each method: 224 vs DDP's 200 for 2.5; 200 vs DDP's 180 for 2.6
    assert [ln for ln in lines if ln.startswith("- ")] == [
        "- DDP-lr-0.001's loss, each method at its best lr of the grid: `int4_streaming` "
        "224 steps, DDP 200: steps x 1.12.",
        "- DDP-lr-0.0007's loss, each method at its best lr of the grid: `int4_streaming` "
        "200 steps, DDP 180: steps x 1.11.",
    ]
