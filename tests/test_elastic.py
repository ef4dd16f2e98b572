"""examples/elastic.py under torchrun --max-restarts 2: a rank killed twice with SIGKILL
(once before a step, once inside a checkpoint save) costs steps, never exactness.

Each killed run must end with every rank's model and optimizer state bit-identical
(``torch.equal``) to an uninterrupted run's, having resumed from the newest round every
rank completed: the round the killed rank was half-way through saving, which the other
rank had finished, is not used. Once on one node (the killed worker's torchrun restarts
the group), once as two torchrun nodes in two network namespaces (the node holding the
killed rank dies whole and a fresh torchrun replaces it); that one needs root and
``ip netns``. The time from each kill to the next completed round and the steps redone
are printed (``pytest -s``).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "benchmarks"))
from harness import elastic, netns  # noqa: E402

# one module-scoped run serves every test: one worker runs them all, first
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_elastic")]

ARGS = ["--steps", "40"]  # warm-up 4, period 4: round k after step 4k; 10 rounds with the last
# rank 0 dies before step 15 (newest common round: 3, after step 12: 2 steps redone); then
# rank 1 dies saving round 7 (after step 28) with rank 0's save of it complete: resume at 6
STEP_KILL, SAVE_KILL = (15, 3, 13, 2), (7, 6, 25, 4)  # (at, restored round, its step, redone)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = str(tmp_path_factory.mktemp("uninterrupted"))
    result = elastic.run_scenario(run, example_args=ARGS, timeout_s=150)
    assert (result["steps"], result["rounds"], result["kills"]) == (40, 10, [])
    return run


def _check(result, run, reference, target):
    print()
    print(elastic.table([dict(result, scenario=target, equal=True)]))
    step, save = result["kills"]
    for k, (at, restored, restored_step, redone) in zip((step, save), (STEP_KILL, SAVE_KILL)):
        assert k["at"] == at and k["target"] == target
        assert (k["restored_round"], k["restored_step"], k["steps_redone"]) == (
            restored, restored_step, redone), k
        assert 0 < k["resume_s"] <= k["next_round_s"] < 60, k
    # when rank 1 was killed inside its save of round 7, rank 0 had completed it
    assert 7 in save["completed"][0] and 7 not in save["completed"].get(1, []), save["completed"]
    assert (result["steps"], result["rounds"]) == (40, 10)
    assert elastic.finals_equal(run, reference)
    # the comparison covers each rank's own state: local momentum differs between ranks
    r0, r1 = (torch.load(os.path.join(run, f"final_rank{r}.pt"), weights_only=False)
              for r in (0, 1))
    m0, m1 = (o["optimizer"]["state"][0]["momentum_buffer"] for o in (r0, r1))
    assert not torch.equal(m0, m1)


def test_killed_worker_resumes_bit_identical(tmp_path, uninterrupted):
    kills = [elastic.Kill("step", STEP_KILL[0], rank=0), elastic.Kill("save", SAVE_KILL[0], rank=1)]
    result = elastic.run_scenario(str(tmp_path), kills, example_args=ARGS, timeout_s=150)
    _check(result, str(tmp_path), uninterrupted, "worker")


NETNS_OK, NETNS_WHY = netns.netns_available()


@pytest.mark.skipif(not NETNS_OK, reason=f"two nodes need network namespaces: {NETNS_WHY}")
def test_killed_node_resumes_bit_identical(tmp_path, uninterrupted):
    # rank 1's node both times: node a hosts the rendezvous (is_host), which torchrun
    # cannot move, so losing it ends the job
    kills = [elastic.Kill("step", STEP_KILL[0], rank=1, target="node"),
             elastic.Kill("save", SAVE_KILL[0], rank=1, target="node")]
    with netns.NetnsPair(netns.PROFILES["1gbit"], tag="el") as pair:
        result = elastic.run_scenario(str(tmp_path), kills, pair=pair, example_args=ARGS,
                                      timeout_s=150)
    _check(result, str(tmp_path), uninterrupted, "node")
