"""``bench_train.py``'s per-variant flags: where they go, and the mistakes it refuses
before any training starts."""
from __future__ import annotations

import pytest


def test_variant_flags_are_split_and_joined_per_variant(bench_train):
    flags = bench_train._variant_flags(
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
