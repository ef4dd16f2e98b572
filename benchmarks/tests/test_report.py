"""The report writer on a fixture: definitions, table, RESULTS.md section, plot."""
from __future__ import annotations

import pytest

from harness import report


def _run(hook, steps, evals, median, mean, bytes_per_step, local=None, comm=0.0):
    return {"config": {"hook": hook, "steps": steps},
            "summary": {"median_step_s": median, "mean_step_s": mean,
                        "bytes_per_step": bytes_per_step,
                        "comm_share": comm, "median_local_step_s": local,
                        "wire_bytes_per_step": None},
            "evals": [{"step": s, "train_s": t, "bytes": b, "val_loss": v} for s, t, b, v in evals]}


@pytest.fixture
def runs():
    return {
        "none": _run("none", 4, [(2, 0.2, 0, 3.5), (4, 0.4, 0, 3.0)], 0.1, 0.1, 0, local=0.1),
        "ddp": _run("ddp", 4, [(2, 1.0, 20, 3.0), (4, 2.0, 40, 2.0)], 0.5, 0.5, 10e6, comm=0.8),
        "torch_localsgd": _run("torch_localsgd", 8, [(2, 0.5, 4, 3.2), (4, 1.0, 8, 2.4),
                                                     (6, 1.5, 12, 2.1), (8, 2.0, 16, 1.9)],
                               0.12, 0.25, 2e6, local=0.12),
        "ours": _run("ours", 8, [(2, 0.3, 4, 3.1), (4, 0.6, 8, 2.04), (6, 0.9, 12, 1.99),
                                 (8, 1.2, 16, 1.9)], 0.11, 0.15, 2e6, local=0.11),
        "slow": _run("slow", 8, [(4, 3.0, 8, 2.5), (8, 6.0, 16, 2.2)], 0.75, 0.75, 1e6),
    }


def test_summarize_definitions(runs):
    rows = {r["variant"]: r for r in report.summarize(runs)}
    assert rows["ddp"]["time_to_target_s"] == 2.0                     # target = its own final loss
    assert rows["ours"]["time_to_target_s"] == 0.9                    # first eval <= 2.0
    assert rows["torch_localsgd"]["time_to_target_s"] == 2.0
    assert rows["slow"]["time_to_target_s"] is None                   # not reached in 2x budget
    assert rows["ours"]["ttt_speedup_vs_ddp"] == pytest.approx(2.0 / 0.9)
    assert rows["ours"]["ttt_speedup_vs_torch"] == pytest.approx(2.0 / 0.9)
    assert rows["ddp"]["mb_to_target"] == 40e-6 and rows["ours"]["mb_to_target"] == 12e-6
    assert rows["ours"]["bytes_saving_vs_ddp"] == pytest.approx(40 / 12)  # bytes at that eval
    assert rows["slow"]["mb_to_target"] is None and rows["slow"]["bytes_saving_vs_ddp"] is None
    assert rows["none"]["mb_to_target"] is None
    assert rows["ours"]["val_at_budget"] == 2.04                      # loss at equal samples
    assert rows["ours"]["gap_pct"] == pytest.approx(2.0)
    assert rows["ours"]["local_overhead"] == pytest.approx(1.1)
    assert rows["none"]["local_overhead"] is None and rows["none"]["time_to_target_s"] is None
    assert rows["ddp"]["mb_per_step"] == 10.0
    assert rows["ours"]["speedup"] == pytest.approx(0.5 / 0.15)


def test_markdown_table(runs):
    table = report.markdown_table(report.summarize(runs), report.BENCH_COLUMNS)
    lines = table.splitlines()
    assert len(lines) == 2 + len(runs)
    assert all(line.count("|") == len(report.BENCH_COLUMNS) + 1 for line in lines)
    slow = next(line for line in lines if line.startswith("| slow "))
    assert "not reached" in slow
    ours = next(line for line in lines if line.startswith("| ours "))
    assert "| +2.0% |" in ours and "| 0.9 |" in ours and "| 2.22 |" in ours
    none = next(line for line in lines if line.startswith("| none "))
    assert "not reached" not in none


def test_write_section_keeps_other_sections(tmp_path):
    path = tmp_path / "RESULTS.md"
    report.write_section(str(path), "first table")
    assert path.read_text().startswith("# Benchmark results\n")
    text = path.read_text() + "\n## Ops: fused bucket copies\n\nops numbers\n"
    path.write_text(text)
    report.write_section(str(path), "second table")
    out = path.read_text()
    assert "first table" not in out and "second table" in out
    assert out.count(report.SECTION) == 1
    assert "## Ops: fused bucket copies\n\nops numbers" in out
    assert out.index(report.SECTION) < out.index("## Ops: fused bucket copies")


def test_plot(tmp_path, runs):
    pytest.importorskip("matplotlib")
    path = report.plot({"loopback": runs, "100mbit": runs}, str(tmp_path / "p.png"), title="t")
    assert path and (tmp_path / "p.png").stat().st_size > 10_000


def test_time_to_target_interpolates(runs):
    ours = runs["ours"]  # (0.6 s, 2.04) then (0.9 s, 1.99): 2.0 is 4/5 of the way
    assert report.time_to_target(ours, 2.0) == 0.9
    assert report.time_to_target(ours, 2.0, interpolate=True) == pytest.approx(0.84)
    assert report.time_to_target(ours, 3.5, interpolate=True) == 0.3  # the first eval: its time
    assert report.time_to_target(ours, 1.0, interpolate=True) is None


def _timed(hook, steps_done, evals, mean, bytes_per_step, stopped_by="time_budget"):
    run = _run(hook, 1000, evals, mean, mean, bytes_per_step)
    run["config"]["steps_done"] = steps_done
    run["summary"].update(train_s=evals[-1][1], stopped_by=stopped_by)
    return run


@pytest.fixture
def equal_time_runs():
    return {
        "ddp": _timed("ddp", 4, [(2, 1.0, 20, 3.0), (4, 2.0, 40, 2.0)], 0.5, 10e6, "steps"),
        # crosses 2.0 between 1.0 s (2.2) and 1.5 s (1.8): at 1.25 s
        "fast": _timed("fast", 16, [(4, 0.5, 4, 2.6), (8, 1.0, 8, 2.2), (12, 1.5, 12, 1.8),
                                    (16, 2.01, 16, 1.7)], 0.125, 1e6),
        "slow": _timed("slow", 8, [(4, 1.0, 4, 2.9), (8, 2.02, 8, 2.4)], 0.25, 1e5),
    }


def test_summarize_equal_time(equal_time_runs):
    rows = {r["variant"]: r for r in report.summarize_equal_time(equal_time_runs)}
    assert [r["variant"] for r in report.summarize_equal_time(equal_time_runs)] == [
        "ddp", "fast", "slow"]
    assert rows["ddp"]["time_to_target_s"] == 2.0 and rows["ddp"]["speedup"] == 1.0
    assert rows["fast"]["val_at_equal_time"] == 1.7 and rows["fast"]["steps"] == 16
    assert rows["fast"]["gap_pct"] == pytest.approx(-15.0)
    assert rows["fast"]["time_to_target_s"] == pytest.approx(1.25)
    assert rows["fast"]["speedup"] == pytest.approx(2.0 / 1.25)
    assert rows["fast"]["mb_per_step"] == 1.0 and rows["fast"]["mean_step_ms"] == 125.0
    assert rows["fast"]["train_s"] == 2.01 and rows["fast"]["stopped_by"] == "time_budget"
    assert rows["slow"]["time_to_target_s"] is None and rows["slow"]["speedup"] is None
    assert rows["slow"]["gap_pct"] == pytest.approx(20.0)


def test_summarize_equal_time_without_baseline(equal_time_runs):
    del equal_time_runs["ddp"]
    rows = report.summarize_equal_time(equal_time_runs)
    assert all("time_to_target_s" not in r and "speedup" not in r for r in rows)
    table = report.markdown_table(rows, report.DEMO_COLUMNS)
    assert "not reached" not in table and "| fast | 16 | 2.0 | 1.700 | n/a | n/a | n/a |" in table


def test_demo_table(equal_time_runs):
    table = report.markdown_table(report.summarize_equal_time(equal_time_runs), report.DEMO_COLUMNS)
    lines = table.splitlines()
    assert lines[0] == ("| variant | steps | train s | val loss @ equal time | gap vs DDP | "
                        "time to DDP's loss s | speedup vs DDP | time/step ms | MB/step |")
    assert len(lines) == 2 + len(equal_time_runs)
    assert lines[2] == "| ddp | 4 | 2.0 | 2.000 | +0.0% | 2.0 | 1.00 | 500.0 | 10.000 |"
    assert lines[3] == "| fast | 16 | 2.0 | 1.700 | -15.0% | 1.2 | 1.60 | 125.0 | 1.000 |"
    assert lines[4] == "| slow | 8 | 2.0 | 2.400 | +20.0% | not reached | n/a | 250.0 | 0.100 |"


def test_plot_marks_target_and_budget(tmp_path, equal_time_runs):
    pytest.importorskip("matplotlib")
    path = report.plot({"net": equal_time_runs}, str(tmp_path / "d.png"), title="t",
                       target=2.0, budget_s=2.0)
    assert path and (tmp_path / "d.png").stat().st_size > 10_000


def test_interpolated_times_the_limit_and_its_two_factors(runs):
    rows = {r["variant"]: r for r in report.summarize(runs, interpolate=True)}
    # target 2.0 (DDP's last validation): DDP reaches it at step 4, 2.0 s; none steps 0.1 s
    assert rows["ddp"]["steps_to_target"] == 4 and rows["ours"]["limit_s"] == 4 * 0.1
    # ours: between (4, 0.6 s, 2.04) and (6, 0.9 s, 1.99): 0.8 of the way
    assert rows["ours"]["steps_to_target"] == pytest.approx(5.6)
    assert rows["ours"]["time_to_target_s"] == pytest.approx(0.84)
    assert rows["ours"]["x_of_limit"] == pytest.approx(0.84 / 0.4)
    assert rows["ours"]["steps_x"] == pytest.approx(5.6 / 4)
    assert rows["ours"]["step_time_x"] == pytest.approx((0.84 / 5.6) / 0.1)
    assert rows["ours"]["x_of_limit"] == pytest.approx(rows["ours"]["steps_x"]
                                                      * rows["ours"]["step_time_x"])
    # PyTorch's local SGD: between (6, 1.5 s, 2.1) and (8, 2.0 s, 1.9): half way
    pma = 1.5 + (2.1 - 2.0) / (2.1 - 1.9) * 0.5
    assert rows["ours"]["vs_pma"] == pytest.approx(pma / 0.84)
    assert rows["torch_localsgd"]["vs_pma"] is None and rows["ours"]["vs_torchft"] is None


def test_repeats_report_the_median_and_the_spread(runs):
    import copy

    slower = copy.deepcopy(runs)
    for e in slower["ours"]["evals"]:
        e["train_s"] *= 2
    faster = copy.deepcopy(runs)
    for e in faster["ours"]["evals"]:
        e["train_s"] /= 2
    rows = report.aggregate([report.summarize(r, interpolate=True)
                             for r in (runs, slower, faster)])
    ours = next(r for r in rows if r["variant"] == "ours")
    assert ours["time_to_target_s"] == pytest.approx(0.84) and ours["repeats"] == 3
    assert ours["time_to_target_s_range"] == pytest.approx((0.42, 1.68))
    table = report.markdown_table(rows, report.REPEAT_COLUMNS)
    assert "| ours | 8 |" in table and "0.8 (0.4–1.7)" in table


def test_repeats_rotate_the_order_and_the_first_runs_ddp_first():
    import bench_train

    variants = ["none", "ddp", "a", "b"]
    assert bench_train._rotated(variants, 0) == ["ddp", "none", "a", "b"]
    assert bench_train._rotated(variants, 1) == ["ddp", "a", "b", "none"]
    assert bench_train._rotated(variants, 2) == ["a", "b", "none", "ddp"]
