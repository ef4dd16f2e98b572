"""The variants taking turns in one run (``harness/local_step.py``, ``bench_local_step.py``):
each computes what its own ``train.py`` run computes, and the ratios are taken per turn."""
from __future__ import annotations

import doctest
import importlib.util
import json
import os

import pytest

from harness import launch, local_step

COMMON = ["--preset", "tiny", "--lr", "3e-3", "--period", "4", "--corpus-bytes", "400000",
          "--seed", "1", "--timeout", "60"]
TITLE = "The local step of two fragments, taking turns"
BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_extension_build(monkeypatch):
    monkeypatch.setenv("DDP_AVG_HOOKS_DISABLE_EXT", "1")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_local_step", os.path.join(BENCHMARKS, "bench_local_step.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_variant_computes_what_its_own_run_computes(tmp_path):
    # blocking rounds, and overlapped ones landing at a fixed step: every loss is the one
    # of the variant's own train.py run, though three variants share the processes
    names = ["none", "allreduce", "int4_streaming_interleaved_next_step"]
    turns = launch.run_training(
        ["--variants", ",".join(names), "--blocks", "2", "--block-steps", "8", *COMMON],
        str(tmp_path / "turns"), script=local_step.__file__, timeout_s=180)["turns"]
    assert list(turns) == names
    assert all(set(local_step.PARTS) <= set(r) for recs in turns.values() for r in recs)
    for name in names:
        assert [(r["block"], r["pos"]) for r in turns[name]] == \
            [(b, p) for b in range(3) for p in range(8)]
    for name in names[1:]:
        alone = launch.run_training(
            ["--hook", name, "--steps", "24", "--eval-every", "0", "--progress", "off", *COMMON],
            str(tmp_path / name), timeout_s=180)
        assert [r["loss"] for r in turns[name]] == [r["loss"] for r in alone["steps"]], name
        # what the training thread sent, step by step (an overlapped round's codes go
        # from the background thread, at whatever step it gets to them)
        own = lambda recs: [(r["averaged"], r["bytes"] - r["background_bytes"]) for r in recs]
        assert own(turns[name]) == own(alone["steps"]), name
    # none's training thread sends nothing; what a background thread sends in its turn is
    # the round of the variant before it, still in flight at the start of the block
    assert all(r["bytes"] == r["background_bytes"] and not r["averaged"]
               for r in turns["none"])


def test_a_variants_own_flags_reach_it_alone(tmp_path):
    # the same hook twice over is refused, so two hooks: one with its own period and
    # fragments, one without; each loses what its own train.py run with those flags loses
    own = ["--period", "2", "--fragments", "2"]
    names = ["none", "int4_streaming_interleaved_next_step", "allreduce"]
    run = launch.run_training(
        ["--variants", ",".join(names), "--blocks", "1", "--block-steps", "8", *COMMON,
         "--variant-args", f"{names[1]}={' '.join(own)}"],
        str(tmp_path / "turns"), script=local_step.__file__, timeout_s=180)
    assert run["config"]["variant_flags"] == {names[1]: own}
    for name, flags in [(names[1], own), (names[2], [])]:
        alone = launch.run_training(
            ["--hook", name, "--steps", "16", "--eval-every", "0", "--progress", "off",
             *COMMON, *flags], str(tmp_path / name), timeout_s=180)
        assert [r["loss"] for r in run["turns"][name]] == [r["loss"] for r in alone["steps"]]
        assert [r["averaged"] for r in run["turns"][name]] == \
            [r["averaged"] for r in alone["steps"]], name
    # period 2 in 2 fragments: a round at every step after the warm-up, unlike period 4
    assert sum(r["averaged"] for r in run["turns"][names[1]]) > \
        sum(r["averaged"] for r in run["turns"][names[2]])


def test_turn_order_rotates_by_one_per_block():
    assert [local_step.turn_order(["a", "b", "c"], k) for k in range(4)] == \
        [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


@pytest.mark.parametrize("argv, says", [
    (["--variants", "none,torchft_diloco"], "peer libraries"),
    (["--variants", "none,fsdp_int8"], "FSDP2"),
    (["--variants", "none,no_such_hook"], "unknown variant 'no_such_hook'"),
    (["--variants", "none,int4_streaming,none"], "appears twice"),
    (["--variants", "none,int4_streaming", "--variant-args", "int4_streaming"],
     "expected VARIANT=FLAGS"),
    (["--variants", "none,int4_streaming", "--variant-args", "int8_streaming=--period 4"],
     "'int8_streaming' is not among --variants (none,int4_streaming)"),
])
def test_variants_that_cannot_take_turns_are_refused(argv, says, capsys):
    with pytest.raises(SystemExit):
        local_step.parse_args(argv)
    assert says in capsys.readouterr().err


def _rec(block, pos, step_s, nbytes=0, comm_s=0.0):
    return dict(block=block, pos=pos, step_s=step_s, bytes=nbytes, averaged=nbytes > 0,
                comm_s=comm_s)


def test_ratios_are_taken_within_a_turn_and_leave_out_the_warmup(bench):
    # turn 1: none 10 ms; x's local steps 11 and 12 ms, one round step 20 ms (comm 4 ms).
    # turn 2: the host twice as slow for both. Block 0 and each block's first step
    # (skip=1) must not count, whatever they hold.
    turns = {
        "none": [_rec(0, 1, 1.0), _rec(1, 0, 9.0), _rec(1, 1, 0.010), _rec(1, 2, 0.010),
                 _rec(1, 3, 0.010), _rec(2, 0, 9.0), _rec(2, 1, 0.020), _rec(2, 2, 0.020),
                 _rec(2, 3, 0.020)],
        "x": [_rec(0, 1, 5.0), _rec(1, 0, 9.0), _rec(1, 1, 0.011), _rec(1, 2, 0.012),
              _rec(1, 3, 0.020, nbytes=8, comm_s=0.004), _rec(2, 0, 9.0), _rec(2, 1, 0.022),
              _rec(2, 2, 0.024), _rec(2, 3, 0.040, nbytes=8, comm_s=0.008)],
    }
    ratios = bench.turn_ratios(turns, skip=1)
    assert [t["turn"] for t in ratios["x"]] == [1, 2]
    for t in ratios["x"]:
        assert t["local_x"] == pytest.approx(1.15)       # median of 11, 12 over 10
        assert t["step_x"] == pytest.approx(43 / 30)     # mean of 11, 12, 20 over 10
        assert t["comm"] == pytest.approx(4 / 43)
    rows = bench.summarize(ratios)
    row = {r["variant"]: r for r in rows}["x"]
    assert row["local_x"] == pytest.approx(1.15) and row["local_met"] == 0
    assert row["local_ms"] == pytest.approx((11.5 + 23) / 2)
    assert "| `x` | 17.2 | 1.150 (1.150–1.150) | 0 of 2 |" in "\n".join(bench.table([rows]))
    # a second run, 0.03 slower in local step: the table gets a run column, and the move
    # between the runs is the largest of any variant's
    later = [dict(r, local_x=r["local_x"] + 0.03) if r["local_x"] else r for r in rows]
    assert "| `x` | 2 | " in "\n".join(bench.table([rows, later]))
    assert bench.between_runs([rows, later])["local_x"] == pytest.approx(0.03)


def test_the_mean_step_is_split_into_its_parts_within_a_turn(bench):
    # turn 1: none's forward and backward 8 ms a step, x's 8.8 (its round's background
    # work beside it, 0.5 ms of other threads' CPU a step); turn 2 the host twice as slow
    # (its own CPU time in them 7.6 and 8.0 ms: the rest it waited for a core)
    def rec(block, pos, fwd, cpu, avg=0.0, other=0.0):
        return dict(_rec(block, pos, fwd + 0.002 + avg, comm_s=avg), fwd_bwd_s=fwd,
                    fwd_bwd_cpu_s=cpu, opt_s=0.002, avg_s=avg, other_cpu_s=other)
    turns = {"none": [rec(1, 1, 0.008, 0.0076), rec(1, 2, 0.008, 0.0076),
                      rec(2, 1, 0.016, 0.0152), rec(2, 2, 0.016, 0.0152)],
             "x": [rec(1, 1, 0.0088, 0.008, 0.001, 0.0005), rec(1, 2, 0.0088, 0.008, 0.0, 0.0005),
                   rec(2, 1, 0.0176, 0.016, 0.002, 0.001), rec(2, 2, 0.0176, 0.016, 0.0, 0.001)]}
    rows = bench.summarize(bench.turn_ratios(turns, skip=1))
    x = {r["variant"]: r for r in rows}["x"]
    assert x["fwd_bwd_x"] == pytest.approx(1.1) and x["fwd_bwd_x_range"] == \
        pytest.approx((1.1, 1.1))
    assert x["avg_ms"] == pytest.approx((0.5 + 1.0) / 2)        # mean over each block's steps
    assert x["other_cpu_ms"] == pytest.approx((0.5 + 1.0) / 2)
    lines = "\n".join(bench.breakdown([rows]))
    assert "| `none` | 12.0 | 1 | 11.4 | 2.00 | 0.00 | 0.00 |" in lines
    assert "| `x` | 13.2 | 1.100 (1.100–1.100) | 12.0 | 2.00 | 0.75 | 0.75 |" in lines
    # a run saved before the CPU time was kept: the other parts, without that column
    for recs in turns.values():
        for r in recs:
            del r["fwd_bwd_cpu_s"]
    lines = "\n".join(bench.breakdown([bench.summarize(bench.turn_ratios(turns, skip=1))]))
    assert "its CPU time" not in lines
    assert "| `x` | 13.2 | 1.100 (1.100–1.100) | 2.00 | 0.75 | 0.75 |" in lines
    # a run saved before the parts were kept: no breakdown, the first table as before
    old = bench.summarize(bench.turn_ratios({"none": [_rec(1, 1, 0.01)],
                                             "x": [_rec(1, 1, 0.011)]}, skip=1))
    assert bench.breakdown([old]) == [] and bench.table([old])


def test_a_variant_without_local_steps_has_no_turns_within_the_local_step_target(bench):
    # every step of "x" sends (a round launched at every step): no local step to time
    turns = {"none": [_rec(1, 1, 0.010), _rec(2, 1, 0.010)],
             "x": [_rec(1, 1, 0.012, nbytes=8), _rec(2, 1, 0.013, nbytes=8)]}
    rows = bench.summarize(bench.turn_ratios(turns, skip=1))
    row = {r["variant"]: r for r in rows}["x"]
    assert row["local_x"] is None and row["local_turns"] == 0
    table = "\n".join(bench.table([rows]))
    assert "| `x` | n/a | n/a | n/a | 12.5 | 1.250 (1.200–1.300) |" in table


@pytest.mark.torchrun
def test_bench_writes_its_section_and_the_turns(bench, tmp_path):
    md = tmp_path / "RESULTS.md"
    md.write_text("# Benchmark results\n\n## Another section\n\nkept\n")
    assert bench.main(["--profiles", "loopback", "--seeds", "0", "--blocks", "2",
                       "--block-steps", "4", "--skip", "1", "--preset", "tiny", "--runs", "2",
                       "--variants", "none,int4_streaming", "--train-args",
                       "--corpus-bytes 400000 --timeout 60", "--out", str(tmp_path / "res"),
                       "--variant-args", "int4_streaming=--fragments 2", "--title", TITLE,
                       "--runs-dir", str(tmp_path / "runs"), "--results-md", str(md)]) == 0
    saved = json.loads((tmp_path / "res" / "local_step_loopback_seed0.json").read_text())
    assert len(saved["runs"]) == 2
    for run in saved["runs"]:
        assert [r["variant"] for r in run["rows"]] == ["none", "int4_streaming"]
        assert [t["turn"] for t in run["turns"]["int4_streaming"]] == [1, 2]
    text = md.read_text()
    section = "## " + TITLE
    assert "## Another section\n\nkept" in text and section in text
    assert bench.SECTION not in text
    assert "| `int4_streaming` | 2 |" in text and "Between the runs" in text
    assert "Each variant's own flags: `int4_streaming` `--fragments 2`." in text
    assert "Where the mean step goes" in text and "other threads' CPU" in text
    assert "Comm wait over every timed step" in text
    # --replot rebuilds the same section from the JSON alone
    md.write_text("# Benchmark results\n")
    assert bench.main(["--profiles", "loopback", "--seeds", "0", "--skip", "1", "--variants",
                       "none,int4_streaming", "--out", str(tmp_path / "res"), "--results-md",
                       str(md), "--title", TITLE, "--replot"]) == 0
    assert section + text.split(section)[1] in md.read_text()


def test_the_limit_is_composed_from_a_bench_train_run(bench, tmp_path):
    (tmp_path / "seed3").mkdir()
    (tmp_path / "seed3" / "train_summary.json").write_text(json.dumps({"rows": {"100mbit": [
        {"variant": "ddp", "steps_x": 1.0}, {"variant": "x", "steps_x": 1.2}]}}))
    runs = [[dict(variant="none", step_x=None), dict(variant="x", step_x=1.05)],
            [dict(variant="none", step_x=None), dict(variant="x", step_x=1.0)]]
    line = bench.composed_limit(runs, str(tmp_path / "seed3"), "100mbit")[0]
    assert "target <= 1.15x: `x` 1.20 x 1.050 / 1.000 = 1.26 / 1.20." in line
    assert "is missing" in bench.composed_limit(runs, str(tmp_path / "nope"), "100mbit")[0]
    assert bench._steps_from("100mbit=results/a{seed}")["100mbit"].endswith("results/a{seed}")
    with pytest.raises(ValueError, match="PROFILE=DIR"):
        bench._steps_from("10mbit=results/a")


def test_bench_refuses_what_it_cannot_measure(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "none,accelerate_localsgd", "--profiles", "loopback"])
    assert "peer libraries" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--profiles", "loopback", "--variant-args", "int2_streaming=--period 4"])
    assert "'int2_streaming' is not among --variants" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--profiles", "loopback", "--skip", "16"])
    assert "--skip 16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--profiles", "loopback,10mbit"])
    assert "unknown 10mbit; choose from 100mbit, 1gbit, 25mbit, loopback" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--profiles", "loopback", "--seeds", "0,one"])
    assert "--seeds 0,one: expected comma-separated integers" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--replot: .*missing"):
        bench.main(["--profiles", "loopback", "--replot", "--out", "/nonexistent/local_step"])


def test_docstring_examples(bench):
    assert doctest.testmod(bench).failed == 0
