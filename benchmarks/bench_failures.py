"""What a killed rank costs local SGD under torchrun: time lost, steps redone, exactness.

    python benchmarks/bench_failures.py [--steps 40] [--scenarios worker,node]
        [--profile 1gbit] [--out benchmarks/results/failures.json]

Runs ``examples/elastic.py`` (2 ranks, period 4, a checkpoint after every round) with
``torchrun --max-restarts 2`` and SIGKILLs it twice from outside: once before step 15,
once inside a checkpoint save of round 7, after the other rank finished saving it.

* ``worker``: one node (one torchrun, 2 workers); rank 0 then rank 1 is killed, and the
  node's torchrun restarts both workers each time.
* ``node``: two torchrun nodes in two network namespaces joined by a veth pair
  (``--profile``; needs root and ``ip netns``, else skipped with the reason); the node of
  rank 1 is killed whole, both times, and a fresh torchrun replaces it.

Each scenario is also run uninterrupted in the same layout. Per failure the table gives
the round resumed from, the steps redone, the seconds from the kill to every rank having
resumed and to the next completed round; per scenario, whether every rank's final model
and optimizer state equal (``torch.equal``) the uninterrupted run's, and the extra wall
time per failure. The seconds are mostly process start-up (Python, torch, DDP) and
torchrun's restart, so they depend on the machine's load; read them beside each other.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import elastic, netns  # noqa: E402

KILLS = {
    "worker": [elastic.Kill("step", 15, rank=0), elastic.Kill("save", 7, rank=1)],
    "node": [elastic.Kill("step", 15, rank=1, target="node"),
             elastic.Kill("save", 7, rank=1, target="node")],
}


def _scenario(name: str, args: list[str], profile: str, work: str) -> dict:
    def run(tag, kills, pair=None):
        return elastic.run_scenario(os.path.join(work, f"{name}_{tag}"), kills, pair=pair,
                                    example_args=args, timeout_s=400)

    if name == "node":
        ok, why = netns.netns_available()
        if not ok:
            return dict(scenario=name, skipped=f"two nodes need network namespaces: {why}")
        with netns.NetnsPair(netns.PROFILES[profile], tag="bf") as pair:
            straight, killed = run("uninterrupted", [], pair), run("killed", KILLS[name], pair)
    else:
        straight, killed = run("uninterrupted", []), run("killed", KILLS[name])
    equal = elastic.finals_equal(os.path.join(work, f"{name}_killed"),
                                 os.path.join(work, f"{name}_uninterrupted"))
    extra = (killed["wall_s"] - straight["wall_s"]) / len(killed["kills"])
    return dict(killed, scenario=name, equal=equal, uninterrupted_wall_s=straight["wall_s"],
                extra_wall_per_failure_s=extra)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--scenarios", default="worker,node")
    p.add_argument("--profile", default="1gbit", choices=sorted(netns.PROFILES))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                 "failures.json"))
    a = p.parse_args()
    if a.steps < 33:
        p.error("--steps must be >= 33: the kills fall before step 15 and in round 7's save")
    args = ["--steps", str(a.steps)]
    work = tempfile.mkdtemp(prefix="dah_failures_")
    try:
        rows = [_scenario(name, args, a.profile, work) for name in a.scenarios.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    done = [r for r in rows if "skipped" not in r]
    print(f"torch {torch.__version__} | examples/elastic.py {' '.join(args)} | 2 ranks | "
          f"torchrun --max-restarts 2")
    print(elastic.table(done))
    for r in rows:
        if "skipped" in r:
            print(f"{r['scenario']}: skipped: {r['skipped']}")
        else:
            print(f"{r['scenario']} ({r['network']}): {r['wall_s']:.1f} s with 2 failures, "
                  f"{r['uninterrupted_wall_s']:.1f} s uninterrupted: "
                  f"{r['extra_wall_per_failure_s']:.1f} s lost per failure")
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(dict(torch=torch.__version__, example_args=args, profile=a.profile,
                       scenarios=rows), f, indent=1)
    if not all(r["equal"] for r in done):
        raise SystemExit("a resumed run did not end bit-identical to the uninterrupted one")


if __name__ == "__main__":
    main()
