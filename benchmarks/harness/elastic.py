"""Kill ranks of ``examples/elastic.py`` under torchrun and measure what each failure cost.

A scenario is one run of the example with ``--max-restarts 2`` and a list of
:class:`Kill`: each names a pause point of the example (before a step, or inside the save
of a round, after this rank's files and before its completion marker) and a rank. The
example stops there and writes ``paused-<kind>-<n>`` (its pid and the steps it had done);
the driver then sends ``SIGKILL`` from outside, to the worker (``target="worker"``: the
local torchrun agent restarts the group) or to the whole torchrun of that rank's node
(``target="node"``: the node is gone; a fresh torchrun takes its place, as a scheduler
would start a replacement). Two layouts:

* one node: one torchrun, ``--nnodes 1 --nproc-per-node 2``, c10d rendezvous on loopback;
* two nodes: one torchrun per network namespace (:class:`~harness.netns.NetnsPair`),
  ``--nnodes 2 --nproc-per-node 1``, rendezvous and gloo over the veth link.

Per failure, from the example's event log: ``resume_s`` (kill to every rank resumed from
a checkpoint), ``next_round_s`` (kill to the next completed round), ``restored_round``,
``steps_redone`` (steps the killed rank had done minus the step the run resumed at). Per
run: wall time, and whether the final model and optimizer state of every rank are
bit-identical (``torch.equal``) to an uninterrupted run's.

>>> Kill("save", 7, rank=1).marker
'paused-save-7'
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .launch import (LaunchError, kill_tree, log_tail, parent_pids, stop_signals_raise,
                     two_node_commands)
from .netns import NetnsPair

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "elastic.py")
# a dead node's rendezvous entry expires after interval * attempts seconds (torch: 5 * 3)
RDZV_CONF = "keep_alive_interval=1,keep_alive_max_attempt=3"
# torchrun (2.13) shares its rendezvous store with the workers by default, and a restart
# keeps it: the restarted workers' gloo can read a peer address the previous attempt left
# there and fail with "connectFullMesh ... Connection refused";
# and a restarted rank-0 torchrun publishes the store's address only at its first
# rendezvous, so a replacement node waits for it until the store times out. With the
# sharing off, each attempt's rank 0 worker hosts a fresh store, announced every round.
STORE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
ENV = {"step": "DDP_AVG_HOOKS_EXAMPLE_PAUSE_AT_STEP", "save": "DDP_AVG_HOOKS_EXAMPLE_PAUSE_IN_SAVE"}


@dataclasses.dataclass(frozen=True)
class Kill:
    """``SIGKILL`` ``rank`` (its worker or its node) at pause point ``kind`` number ``at``."""
    kind: str  # "step": before step ``at``; "save": inside the save of round ``at``
    at: int
    rank: int
    target: str = "worker"  # or "node": the torchrun of the rank's node, with its workers

    @property
    def marker(self) -> str:
        return f"paused-{self.kind}-{self.at}"


def single_node_command(run_dir: str, example_args: list[str], nproc: int = 2,
                        max_restarts: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
            "--rdzv-id", uuid.uuid4().hex[:8], "--rdzv-conf", RDZV_CONF,
            EXAMPLE, "--dir", run_dir, *example_args]


def _env(kills: list[Kill], extra: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               DDP_AVG_HOOKS_DISABLE_EXT=os.environ.get("DDP_AVG_HOOKS_DISABLE_EXT", "1"))
    for name in ENV.values():
        env.pop(name, None)
    for k in kills:
        if ENV[k.kind] in env:
            raise ValueError(f"one {k.kind!r} kill per run: the example has one such pause point")
        env[ENV[k.kind]] = f"{k.at}:{k.rank}"
    env.update(STORE_ENV)
    env.update(extra or {})
    return env


def run_scenario(run_dir: str, kills: list[Kill] = (), *, pair: NetnsPair | None = None,
                 example_args: list[str] = (), timeout_s: float = 240.0) -> dict:
    """Run the example once, killing as ``kills`` say (in order); returns the measurements.

    ``run_dir`` must be new or empty (the example resumes what it finds there). ``pair``:
    two nodes in two namespaces (rank r on node r); else one node on loopback. Raises
    :class:`~harness.launch.LaunchError` if the job fails or misses its deadline.
    """
    if pair is None and any(k.target == "node" for k in kills):
        raise ValueError("a node kill needs two nodes (pair=): on one node it ends the job")
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    if any(run.iterdir()):
        raise ValueError(f"{run} is not empty: the example would resume what it holds")
    args = list(example_args)
    if pair is None:
        jobs = [(single_node_command(str(run), args), {})]
    else:
        jobs = two_node_commands(pair, ["--dir", str(run), *args], nproc_per_node=1,
                                 script=EXAMPLE, torchrun_args=("--max-restarts", "2"),
                                 rdzv_conf=RDZV_CONF)
    procs: list[subprocess.Popen | None] = [None] * len(jobs)
    logs = [open(run / f"torchrun_node{i}.log", "a") for i in range(len(jobs))]

    def start(i):
        argv, extra = jobs[i]
        procs[i] = subprocess.Popen(argv, env=_env(kills, extra), stdout=logs[i],
                                    stderr=subprocess.STDOUT, start_new_session=True)

    done_kills = []
    t0 = time.time()
    deadline = time.monotonic() + timeout_s
    with stop_signals_raise():
        try:
            for i in range(len(jobs)):
                start(i)
            pending = list(kills)
            while True:
                if pending and (run / pending[0].marker).exists():
                    k = pending.pop(0)
                    paused = json.loads((run / k.marker).read_text())
                    if k.kind == "save":  # kill once the other ranks have finished that save
                        _wait_for_peers_markers(run, k, deadline)
                    completed = _markers(run)
                    t_kill = time.time()
                    if k.target == "node":
                        node = _node_of(paused["pid"], procs)
                        kill_tree(procs[node])
                        start(node)  # the replacement node
                    else:
                        os.kill(paused["pid"], signal.SIGKILL)
                    done_kills.append(dict(dataclasses.asdict(k), t_kill=t_kill,
                                           steps_done=paused["steps_done"], completed=completed))
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    raise LaunchError(f"torchrun exited with {codes}\n"
                                      + _logs_tail(run, len(jobs)))
                if time.monotonic() > deadline:
                    raise LaunchError(f"not finished in {timeout_s:.0f} s\n"
                                      + _logs_tail(run, len(jobs)))
                time.sleep(0.02)
            if any(codes) or pending:
                raise LaunchError(f"exit codes {codes}; kills not reached: {pending}\n"
                                  + _logs_tail(run, len(jobs)))
        finally:
            for p in procs:
                if p is not None and p.poll() is None:
                    kill_tree(p)
            for f in logs:
                f.close()
    wall = time.time() - t0
    events, final = read_events(run), _final(run)
    return dict(wall_s=wall, kills=[_measure(k, events) for k in done_kills],
                rounds=final[0]["rounds"], steps=final[0]["steps"],
                network=pair.describe() if pair else "one node, loopback",
                commands=[" ".join(a) for a, _ in jobs])


def _markers(run: Path) -> dict[int, list[int]]:
    """rank -> the rounds whose completion marker it has written, as of now.

    The job prunes old rounds while this reads, so a round folder may vanish between
    listing ``ckpt`` and listing the folder (``Path.glob`` raises then); it is skipped.
    """
    out: dict[int, list[int]] = {}
    for folder in sorted(_listing(run / "ckpt")):
        if not folder.startswith("round-"):
            continue
        for name in sorted(_listing(run / "ckpt" / folder)):
            if name.startswith("rank") and name.endswith(".done"):
                out.setdefault(int(name[4:-5]), []).append(int(folder[6:]))
    return out


def _listing(folder: Path) -> list[str]:
    """The names in ``folder``; none if it does not exist (any more)."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _wait_for_peers_markers(run: Path, kill: Kill, deadline: float) -> None:
    world = len(list(run.glob("events_rank*.jsonl")))
    end = min(deadline, time.monotonic() + 30)
    while time.monotonic() < end:
        done = {r for r, rounds in _markers(run).items() if kill.at in rounds}
        if done >= set(range(world)) - {kill.rank}:
            return
        time.sleep(0.02)


def _node_of(pid: int, procs: list) -> int:
    """The node whose torchrun started worker ``pid``."""
    parents, roots = parent_pids(), {p.pid: i for i, p in enumerate(procs)}
    while pid in parents and pid not in roots:
        pid = parents[pid]
    if pid not in roots:
        raise LaunchError(f"worker {pid} descends from no node's torchrun")
    return roots[pid]


def _logs_tail(run: Path, n: int) -> str:
    return "".join(f"--- node {i} ---\n" + log_tail(str(run / f"torchrun_node{i}.log"), 40)
                   for i in range(n))


def read_events(run: Path) -> list[dict]:
    out = []
    for path in sorted(run.glob("events_rank*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(out, key=lambda e: e["t"])


def _measure(kill: dict, events: list[dict]) -> dict:
    """What one failure cost, read off the events that followed it."""
    after = [e for e in events if e["t"] > kill["t_kill"]]
    ranks = {e["rank"] for e in events}
    resumes = {}
    for e in after:
        if e["event"] == "resume" and e["rank"] not in resumes:
            resumes[e["rank"]] = e
    if len(resumes) < len(ranks):
        raise LaunchError(f"not every rank resumed after the kill {kill}: {sorted(resumes)}")
    resumed_at = max(e["t"] for e in resumes.values())
    next_round = next(e for e in after if e["event"] == "round" and e["t"] > resumed_at)
    restored = resumes[kill["rank"]]
    return dict(kill, resume_s=resumed_at - kill["t_kill"],
                next_round_s=next_round["t"] - kill["t_kill"],
                restored_round=restored["round"], restored_step=restored["step"],
                steps_redone=kill["steps_done"] - restored["step"])


def _final(run: Path) -> list[dict]:
    import torch
    files = sorted(run.glob("final_rank*.pt"))
    return [torch.load(f, weights_only=False) for f in files]


def finals_equal(a: str, b: str) -> bool:
    """Every rank's final model and optimizer state bit-identical in runs ``a`` and ``b``."""
    import torch

    def same(x, y):
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and torch.equal(x, y)
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return type(x) is type(y) and len(x) == len(y) and all(map(same, x, y))
        return x == y

    fa, fb = _final(Path(a)), _final(Path(b))
    return len(fa) == len(fb) > 0 and all(same(x, y) for x, y in zip(fa, fb))


def table(rows: list[dict]) -> str:
    """A markdown table: one line per failure of each scenario."""
    out = ["| scenario | killed | at | resumed from round | steps redone | kill to resumed (s) "
           "| kill to next round (s) | final params equal to uninterrupted |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for k in r["kills"]:
            where = (f"before step {k['at']}" if k["kind"] == "step"
                     else f"in save of round {k['at']}")
            out.append(f"| {r['scenario']} | rank {k['rank']} ({k['target']}) | {where} "
                       f"| {k['restored_round']} | {k['steps_redone']} | {k['resume_s']:.1f} "
                       f"| {k['next_round_s']:.1f} | {'yes' if r['equal'] else 'NO'} |")
    return "\n".join(out)
