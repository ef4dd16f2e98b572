"""``bench_train.py``'s per-variant flags: where they go, and the mistakes it refuses
before any training starts."""
from __future__ import annotations

import os

import pytest


def test_variant_flags_are_split_and_joined_per_variant():
    from harness.variants import variant_flags

    flags = variant_flags(
        ["int4_streaming=--lr 7e-4", "ddp=--lr-warmup 10", "int4_streaming=--mixing 0.5"],
        ["ddp", "none", "int4_streaming"])
    assert flags == {"int4_streaming": ["--lr", "7e-4", "--mixing", "0.5"],
                     "ddp": ["--lr-warmup", "10"]}


@pytest.mark.parametrize("spec, says", [
    ("int4_streaming --lr 7e-4", "expected VARIANT=FLAGS"),
    ("int4_streaming=", "expected VARIANT=FLAGS"),
    ("int8_streaming=--lr 7e-4",
     "'int8_streaming' is not among --variants (ddp,none,int4_streaming)"),
])
def test_a_malformed_or_unknown_variant_is_refused_before_training(bench_train, capsys, tmp_path,
                                                                    spec, says):
    with pytest.raises(SystemExit) as exc:
        bench_train.main(["--profiles", "loopback", "--variants", "ddp,none,int4_streaming",
                          "--variant-args", spec, "--out", str(tmp_path / "out"),
                          "--runs-dir", str(tmp_path / "runs")])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_replot_rebuilds_a_run_with_its_own_flags(bench_train, tmp_path):
    """A committed run made with a baseline and a no-communication variant of its own
    (``--baseline hsdp_native --none fsdp_none``), rebuilt from ``--out`` alone: the same
    section."""
    import shutil

    run = os.path.join(os.path.dirname(bench_train.__file__), "results", "fsdp_replicas_seed0")
    out, md = tmp_path / "run", tmp_path / "RESULTS.md"
    shutil.copytree(run, out)
    md.write_text("# Results\n")
    assert bench_train.main(["--replot", "--out", str(out), "--results-md", str(md)]) == 0
    with open(os.path.join(run, "train_section.md")) as f:
        assert (out / "train_section.md").read_text() == f.read()
    assert "x sooner than native HSDP" in md.read_text()


def test_replot_of_a_folder_without_a_run_says_what_to_pass(bench_train, capsys, tmp_path):
    with pytest.raises(SystemExit) as err:
        bench_train.main(["--replot", "--out", str(tmp_path)])
    assert err.value.code == 2
    assert "--replot: no " in capsys.readouterr().err
