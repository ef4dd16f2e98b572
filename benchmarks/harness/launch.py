"""Launch ``train.py`` (next to this file) with torchrun, locally or as two "nodes".

- Loopback: ``python -m torch.distributed.run --standalone --nproc-per-node N
  /path/to/benchmarks/harness/train.py ...`` (the rendezvous port is picked by the OS).
- Two nodes in two network namespaces (:class:`~harness.netns.NetnsPair`),
  one torchrun per namespace, exactly what one would type on two machines::

      # node a (10.231.0.1)                      # node b (10.231.0.2)
      GLOO_SOCKET_IFNAME=<veth a> \\             GLOO_SOCKET_IFNAME=<veth b> \\
      torchrun --nnodes 2 --nproc-per-node 1 \\  torchrun --nnodes 2 --nproc-per-node 1 \\
        --rdzv-backend c10d \\                     --rdzv-backend c10d \\
        --rdzv-endpoint 10.231.0.1:29400 \\        --rdzv-endpoint 10.231.0.1:29400 \\
        --rdzv-id ID --local-addr 10.231.0.1 \\    --rdzv-id ID --local-addr 10.231.0.2 \\
        --rdzv-conf is_host=1 .../train.py ...     --rdzv-conf is_host=0 .../train.py ...

Every launch has a deadline; on failure or timeout the whole process tree of each
torchrun is killed (each runs in its own session) before the error is raised. So it is
when the launching process is stopped by SIGTERM or SIGHUP (``kill``, ``timeout``, a
closed terminal) while a job runs (:func:`stop_signals_raise`): no rank outlives it to
take the cores from the next job.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid

from .netns import NetnsPair

# torchrun runs the script by its absolute path: the same from any working directory,
# inside a network namespace too, with no PYTHONPATH to set
TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
RDZV_PORT = 29400
LOOPBACK = "loopback (one host, no shaping)"


class LaunchError(RuntimeError):
    @classmethod
    def timed_out(cls, timeout_s: float, log: str) -> LaunchError:
        return cls(f"training did not finish in {timeout_s:.0f} s (log: {log})")

    @classmethod
    def failed(cls, codes: list, log: str) -> LaunchError:
        """The ranks' (or nodes') exit codes, with the end of the log."""
        return cls(f"training failed with exit codes {codes}; log: {log}\n" + log_tail(log))


def _env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # also silences torchrun's banner about it
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def loopback_command(train_args: list[str], nproc: int = 2, script: str = TRAIN) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), script, *train_args]


def two_node_commands(pair: NetnsPair, train_args: list[str], rdzv_id: str | None = None,
                      nproc_per_node: int = 1, *, script: str = TRAIN,
                      torchrun_args: tuple[str, ...] = (), rdzv_conf: str = ""
                      ) -> list[tuple[list[str], dict]]:
    """(argv, extra env) for the torchrun of each node; node a hosts the rendezvous.

    ``script`` runs instead of ``train.py``; ``torchrun_args`` (e.g. ``--max-restarts 2``)
    and ``rdzv_conf`` (``key=value,...`` after ``is_host``) go to both torchruns.
    """
    rdzv_id = rdzv_id or uuid.uuid4().hex[:8]
    out = []
    for i in (0, 1):
        conf = f"is_host={1 if i == 0 else 0}" + (f",{rdzv_conf}" if rdzv_conf else "")
        argv = pair.exec_prefix(i) + [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{pair.addr[0]}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
            "--local-addr", pair.addr[i], "--rdzv-conf", conf, *torchrun_args,
            script, *train_args]
        out.append((argv, {"GLOO_SOCKET_IFNAME": pair.ifname[i], "DAH_WIRE_IFACE": pair.ifname[i]}))
    return out


def shell_line(argv: list[str], env: dict | None = None) -> str:
    pre = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (pre + " " if pre else "") + " ".join(shlex.quote(a) for a in argv)


@contextlib.contextmanager
def stop_signals_raise():
    """While inside, SIGTERM and SIGHUP raise ``SystemExit(128 + signal)`` in the main
    thread, so the ``finally`` blocks that kill a job's process trees run (by default
    those signals end Python at once). Elsewhere than the main thread: does nothing.

    >>> with stop_signals_raise():
    ...     os.kill(os.getpid(), signal.SIGTERM)
    ...     time.sleep(5)
    Traceback (most recent call last):
    SystemExit: 143
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def parent_pids() -> dict[int, int]:
    """pid -> parent pid of every process (from ``/proc``)."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                # "pid (comm) state ppid ...": comm may hold spaces
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """``SIGKILL`` a torchrun, its process group and every process under it (its workers
    run in sessions of their own, so killing its process group is not enough), then reap it.

    Each process found is stopped (``SIGSTOP``) before its children are looked for, so
    none starts another (torchrun restarting a worker, a rank forking) that the kill
    would miss."""
    tree, found = set(), {proc.pid}
    while found:
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        tree |= found
        found = {p for p, pp in parent_pids().items() if pp in tree} - tree
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def run_training(train_args: list[str], out: str, *, pair: NetnsPair | None = None,
                 nproc: int = 2, timeout_s: float = 600.0, log: str | None = None,
                 stream: bool = False, rdzv_id: str | None = None,
                 script: str = TRAIN) -> dict:
    """Run one training job to completion; returns rank 0's metrics.json (plus launch info).

    ``stream``: the children's stderr (rank 0's progress bar) goes to ours; otherwise
    all output goes to ``log`` (default ``<out>/launch.log``). ``script`` runs instead of
    ``train.py`` (it takes ``--out`` and writes ``<out>/metrics.json`` on rank 0).
    """
    args, log = prepare_job(train_args, out, log)
    if pair is None:
        jobs = [(loopback_command(args, nproc, script), {})]
    else:
        if nproc < 2 or nproc % 2:
            raise ValueError(f"the two-namespace launch runs nproc / 2 ranks on each of its "
                             f"two nodes: nproc must be even and >= 2, got {nproc}")
        jobs = two_node_commands(pair, args, rdzv_id, nproc_per_node=nproc // 2, script=script)
    procs = []
    t0 = time.perf_counter()
    with open(log, "w") as logf, stop_signals_raise():
        for argv, extra in jobs:
            logf.write("$ " + shell_line(argv, extra) + "\n")
        logf.flush()
        try:
            for j, (argv, extra) in enumerate(jobs):  # stream: node 0's stderr only (rank 0's bar)
                procs.append(subprocess.Popen(
                    argv, env=_env(extra), stdout=logf,
                    stderr=None if stream and j == 0 else subprocess.STDOUT,
                    start_new_session=True))
            deadline = time.monotonic() + timeout_s
            while any([p.poll() is None for p in procs]):  # a list: poll every process
                if time.monotonic() > deadline:
                    raise LaunchError.timed_out(timeout_s, log)
                if any(p.returncode not in (None, 0) for p in procs):
                    break  # one node failed: do not wait for the other's timeout
                time.sleep(0.2)
            codes = [p.returncode for p in procs]
            if any(c != 0 for c in codes):
                raise LaunchError.failed(codes, log)
        finally:
            for p in procs:
                if p.poll() is None:
                    kill_tree(p)
    return record_launch(out, [shell_line(a, e) for a, e in jobs], time.perf_counter() - t0,
                         pair.describe() if pair else LOOPBACK)


def prepare_job(train_args: list[str], out: str, log: str | None) -> tuple[list[str], str]:
    """Make ``out`` ready for a job (an old ``metrics.json`` removed); the script's
    arguments (``--out`` added) and the log's path (default ``<out>/launch.log``)."""
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.json")
    if os.path.exists(metrics):
        os.remove(metrics)
    return [*train_args, "--out", out], log or os.path.join(out, "launch.log")


def record_launch(out: str, commands: list[str], wall_s: float, network: str) -> dict:
    """Add how a finished job was launched to its ``<out>/metrics.json`` and return it."""
    metrics = os.path.join(out, "metrics.json")
    with open(metrics) as f:
        result = json.load(f)
    result["launch"] = dict(commands=commands, wall_s=wall_s, network=network)
    with open(metrics, "w") as f:
        json.dump(result, f)
    return result


def log_tail(path: str, n: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return ""
    return "".join(lines[-n:])


def main(argv=None) -> int:
    """Two torchrun nodes: ``PYTHONPATH=benchmarks python -m harness.launch
    [--profile 100mbit] [--record F] -- TRAIN ARGS``.

    Runs the training script as two torchrun nodes in two network namespaces, printing
    the exact command of each node and the outcome.
    """
    import argparse
    from . import netns
    p = argparse.ArgumentParser(
        description="train.py as two torchrun nodes in two network namespaces")
    p.add_argument("--profile", default="100mbit", choices=sorted(netns.PROFILES))
    p.add_argument("--out", default=os.path.join("out", "two_node"))
    p.add_argument("--record", default=None,
                   help="also write the commands and outcome to this JSON")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("train_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    ok, why = netns.netns_available()
    if not ok:
        print(f"cannot make network namespaces here: {why}", file=sys.stderr)
        return 2
    train_args = [x for x in a.train_args if x != "--"]
    prof = netns.PROFILES[a.profile]
    if not prof.shaped:
        prof = netns.Profile("veth", rate_mbit=None)
    with netns.NetnsPair(prof) as pair:
        print(f"network: {pair.describe()}")
        for argv_, extra in two_node_commands(pair, [*train_args, "--out", a.out],
                                              rdzv_id="two-node-demo"):
            print("$ " + shell_line(argv_, extra))
        t0 = time.perf_counter()
        try:
            r = run_training(train_args, a.out, pair=pair, timeout_s=a.timeout, stream=True,
                             rdzv_id="two-node-demo")
            outcome = dict(ok=True, **{k: r["summary"][k] for k in (
                "final_val_loss", "median_step_s", "bytes_per_step", "wire_bytes_per_step",
                "per_rank_train_s")}, world_size=r["config"]["world_size"])
        except LaunchError as exc:
            r, outcome = None, dict(ok=False, error=str(exc)[:2000])
        outcome["wall_s"] = time.perf_counter() - t0
    print(json.dumps(outcome, indent=1))
    if a.record:
        with open(a.record, "w") as f:
            json.dump(dict(network=pair.describe(), train_args=train_args,
                           commands=r["launch"]["commands"] if r else None, outcome=outcome),
                      f, indent=1)
    return 0 if outcome["ok"] else 1


def study_args(doc: str, seeds: str, runs_name: str, argv=None, *,
               reuse: bool = False) -> argparse.Namespace:
    """The flags of a loopback study over seeds (``--seeds``, ``--runs-dir`` under
    ``out/runs_name``, ``--timeout`` a run, ``--results-md``; with ``reuse``, ``--reuse``),
    parsed from ``argv``."""
    benchmarks = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--seeds", default=seeds)
    p.add_argument("--runs-dir", default=os.path.join(benchmarks, os.pardir, "out", runs_name))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--results-md", default=os.path.join(benchmarks, "RESULTS.md"))
    if reuse:
        p.add_argument("--reuse", action="store_true",
                       help="read the runs in --runs-dir made by the same train.py arguments "
                            "instead of training them again")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(main())
