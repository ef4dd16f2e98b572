"""The benchmark's target lines read the numbers the report computes (no training here)."""
from __future__ import annotations

from harness import report


def _run(hook, step_s, evals, bytes_per_step):
    """evals: (step, val_loss); bytes are cumulative at bytes_per_step."""
    return {"config": {"hook": hook, "steps": evals[-1][0]},
            "summary": {"median_step_s": step_s, "mean_step_s": step_s,
                        "bytes_per_step": bytes_per_step, "comm_share": 0.0,
                        "median_local_step_s": step_s, "wire_bytes_per_step": None},
            "evals": [{"step": s, "train_s": s * step_s, "bytes": s * bytes_per_step,
                       "val_loss": v} for s, v in evals]}


def test_overlap_diloco_targets_from_bytes_and_step_times(bench_train):
    runs = {
        "ddp": _run("ddp", 0.4, [(100, 2.5), (200, 2.0)], 32e6),
        "none": _run("none", 0.10, [(100, 2.8), (200, 2.4)], 0),
        "allreduce_overlap": _run("allreduce_overlap", 0.11, [(200, 2.1), (400, 1.9)], 4e6),
        "fp16_overlap": _run("fp16_overlap", 0.12, [(200, 2.1), (400, 1.9)], 2e6),
        # 1e6 B/step to 300 steps = 3e8 B vs DDP's 200 x 32e6 = 6.4e9 B: 21.3x fewer
        "diloco": _run("diloco", 0.1, [(200, 2.2), (300, 1.99), (400, 1.9)], 1e6),
        # 4e6 B/step to 400 steps = 1.6e9 B: only 4x fewer
        "diloco_fp16": _run("diloco_fp16", 0.1, [(200, 2.2), (400, 2.0)], 4e6),
    }
    lines = bench_train._overlap_diloco_targets(report.summarize(runs), "100mbit")
    assert lines == [
        "- Overlap (100mbit): `allreduce_overlap` mean step 1.10x the no-communication step "
        "(target <= 1.15x: met).",
        "- Overlap (100mbit): `fp16_overlap` mean step 1.20x the no-communication step "
        "(target <= 1.15x: not met).",
        "- DiLoCo (100mbit): `diloco` 21.3x fewer bytes than DDP to DDP's target loss "
        "(target >= 16x: met).",
        "- DiLoCo (100mbit): `diloco_fp16` 4.0x fewer bytes than DDP to DDP's target loss "
        "(target >= 16x: not met).",
        "- Bytes to DDP's target (100mbit): fewest with `diloco`, 21.3x fewer than DDP "
        "(target >= 100x: not met).",
    ]
    del runs["diloco_fp16"]["evals"][-1]  # never at or below the target
    lines = bench_train._overlap_diloco_targets(report.summarize(runs), "x")
    assert lines[-2] == ("- DiLoCo (x): `diloco_fp16` not reached within twice DDP's budget: "
                         "not met.")


def test_fewest_bytes_line_counts_the_diloco_4bit_and_fragment_variants_only(bench_train):
    runs = {
        "ddp": _run("ddp", 0.4, [(100, 2.5), (200, 2.0)], 32e6),
        # 1e6 B/step to 300 steps: 21.3x fewer; plain averaging is not a candidate
        "allreduce": _run("allreduce", 0.1, [(200, 2.2), (300, 2.0)], 1e6),
        # 5e4 B/step to 300 steps = 1.5e7 B vs 6.4e9 B: 426.7x fewer
        "diloco_int4": _run("diloco_int4", 0.1, [(200, 2.2), (300, 1.99)], 5e4),
        # 1e5 B/step to 200 steps = 2e7 B: 320x fewer
        "int4_streaming": _run("int4_streaming", 0.1, [(200, 2.0)], 1e5),
    }
    lines = bench_train._overlap_diloco_targets(report.summarize(runs), "p")
    assert lines[-1] == ("- Bytes to DDP's target (p): fewest with `diloco_int4`, 426.7x fewer "
                         "than DDP (target >= 100x: met).")
    del runs["diloco_int4"], runs["int4_streaming"]
    assert not any("Bytes to" in line for line in
                   bench_train._overlap_diloco_targets(report.summarize(runs), "p"))


def test_hierarchical_line_compares_with_flat_averaging(bench_train):
    runs = {
        "ddp": _run("ddp", 0.4, [(100, 2.5), (200, 2.0)], 32e6),
        "allreduce": _run("allreduce", 0.1, [(200, 2.2), (300, 2.0)], 1e6),
        "hierarchical": _run("hierarchical", 0.1, [(200, 2.1), (280, 2.0)], 5e6),
    }
    runs["allreduce"]["summary"]["handle_stats"] = {"bytes_sent": 3e8}
    runs["hierarchical"]["summary"]["handle_stats"] = {"bytes_sent": 2.8e8,
                                                       "node": {"bytes_sent": 1.1e9}}
    rows = bench_train._with_round_bytes(report.summarize(runs), runs)
    (line,) = bench_train._overlap_diloco_targets(rows, "p")
    assert line.startswith("- Hierarchical (p): loss at DDP's budget 2.100 vs 2.200 for flat")
    assert "time to target 28.0 s vs 30.0 s" in line
    assert "280.0 MB vs 300.0 MB, plus 1100.0 MB of node rounds" in line


def test_a_target_line_shows_a_third_decimal_where_rounding_would_hide_the_verdict(bench_train):
    within = (lambda x: x <= 1.05)
    row = {"r": 1.0534, "r_values": [1.0534, 1.02, 1.07], "r_range": (1.02, 1.07)}
    assert bench_train._judged(row, "ratio", "r", within, "target <= 1.05x", 3) == (
        "- ratio: median 1.053, 1.02-1.07 over 3 repeats (target <= 1.05x: not met, "
        "met in 1 of 3 (the spread straddles it)).")
    row = {"r": 1.0449, "r_values": [1.0449], "r_range": (1.0449, 1.0449)}
    assert "median 1.04, 1.04-1.04" in bench_train._judged(row, "ratio", "r", within, "", 1)
