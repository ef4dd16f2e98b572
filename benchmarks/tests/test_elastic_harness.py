"""The kill harness reads the round checkpoints' completion markers while the job prunes
old rounds (no training here)."""
from __future__ import annotations

import os

from harness import elastic


def test_a_round_folder_pruned_while_the_markers_are_read_is_skipped(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    for number, ranks in ((1, (0, 1)), (2, (0,)), (3, (0, 1))):
        folder = ckpt / f"round-{number:08d}"
        folder.mkdir(parents=True)
        for rank in ranks:
            (folder / f"rank{rank}.done").write_text("{}")
        (folder / "rank0.pt").write_text("")
    listdir = os.listdir

    def pruned_meanwhile(path):  # listed in ckpt/, gone when its own listing is asked for
        if os.path.basename(path) == "round-00000001":
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return listdir(path)

    monkeypatch.setattr(elastic.os, "listdir", pruned_meanwhile)
    assert elastic._markers(tmp_path) == {0: [2, 3], 1: [3]}
    assert elastic._markers(tmp_path / "no_run_yet") == {}
