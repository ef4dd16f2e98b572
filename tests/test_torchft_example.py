"""examples/torchft_local_sgd.py runs as written: it starts torchft_lighthouse and two replica
groups with complete Managers; a replica group killed mid-run is dropped from the quorum
and the other goes on averaging alone, nothing restarted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torchft", reason="needs torchft: pip install 'ddp_avg_hooks[peers]'")
EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "torchft_local_sgd.py")


@pytest.mark.slow
def test_the_torchft_example_survives_a_killed_replica_group():
    env = {**os.environ,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
    r = subprocess.run([sys.executable, EXAMPLE, "--steps", "28", "--kill-replica", "1",
                        "--kill-at", "13", "--heartbeat-ms", "500"],
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    rounds = {(int(rid), int(step)): (int(n), state) for rid, step, n, state in re.findall(
        r"replica (\d): round at step (\d+): (\d) participants, (\w+)", r.stdout)}
    for step in (0, 4, 8, 12):  # both replica groups in every round before the kill
        assert rounds[(0, step)] == rounds[(1, step)] == (2, "committed"), r.stdout
    for step in (16, 20, 24):  # then the survivor alone
        assert rounds[(0, step)] == (1, "committed") and (1, step) not in rounds, r.stdout
    assert "replica 0: 7 rounds committed, 0 discarded" in r.stdout
    assert "replica 1: killing itself before step 13" in r.stdout
