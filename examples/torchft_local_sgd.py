"""Fault-tolerant local SGD with torchft: replica groups that may die and rejoin, no restarts.

    python examples/torchft_local_sgd.py [--replicas 2] [--steps 40] [--period 4]
        [--kill-replica 1 --kill-at 13] [--heartbeat-ms 1000]

This program starts everything itself, as you would on a cluster: torchft's lighthouse
(the ``torchft_lighthouse`` server, which decides each round's quorum), then one process
per replica group (``--role replica``), each with a complete ``torchft.Manager``: its own
store, replica id, the lighthouse's address. Each replica group trains a small MLP
(``optimizer=`` steps the handle) and averages the parameters exactly every ``--period``
steps across the replica groups in the quorum, through
``ddp_avg_hooks.integrations.torchft``; a round's participants are in
``FaultTolerantAveraging.rounds``.

With ``--kill-replica R --kill-at S`` replica group R kills itself (SIGKILL) before step
S. The survivors' next quorum waits for its heartbeat until the lighthouse's
``--heartbeat-ms`` passes, then drops it: that is what a death costs, once, in the first
round after it (a shorter timeout drops a dead replica sooner but may drop a slow live
one). Their rounds go on with fewer participants; nothing restarts. Each replica group
prints one line per round: the step, the participants, whether it was committed.
"""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(paths, workers, deadline_s: float = 120) -> None:
    end = time.monotonic() + deadline_s
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > end or any(w.poll() not in (None, 0) for w in workers):
            raise SystemExit("the replica groups did not start")
        time.sleep(0.05)


def lighthouse_program() -> str:
    """The ``torchft_lighthouse`` beside this interpreter (a virtual environment's bin/,
    also when it is not activated), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    found = beside if os.access(beside, os.X_OK) else shutil.which("torchft_lighthouse")
    if found is None:
        raise SystemExit("torchft_lighthouse not found beside this Python or on PATH: "
                         "pip install torchft (or 'ddp_avg_hooks[peers]'), which ships it")
    return found


def launch(args) -> int:
    """Start the lighthouse and the replica groups; wait for the replica groups."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [lighthouse_program(), "--bind", f"127.0.0.1:{port}", "--min_replicas", "1",
         "--join_timeout_ms", "2000", "--quorum_tick_ms", "50",
         "--heartbeat_timeout_ms", str(args.heartbeat_ms)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}
    sync = tempfile.mkdtemp(prefix="torchft_example_")
    workers = [subprocess.Popen(
        [sys.executable, __file__, "--role", "replica", "--replica-id", str(r),
         "--lighthouse", f"http://127.0.0.1:{port}", "--steps", str(args.steps),
         "--period", str(args.period), "--sync-dir", sync, "--kill-at",
         str(args.kill_at if r == args.kill_replica else -1)], env=env)
        for r in range(args.replicas)]
    try:
        # the replica groups start together, as a job's do: once every Manager heartbeats,
        # the lighthouse's first quorum waits for all of them
        wait_for([os.path.join(sync, f"ready{r}") for r in range(args.replicas)], workers)
        open(os.path.join(sync, "go"), "w").close()
        codes = [w.wait(timeout=300) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
        lighthouse.kill()
        shutil.rmtree(sync, ignore_errors=True)
    survivors = [c for r, c in enumerate(codes) if r != args.kill_replica]
    return 0 if all(c == 0 for c in survivors) else 1


def replica(args) -> None:
    """One replica group (here one process) under a torchft Manager."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel
    from torchft import Manager, ProcessGroupGloo

    import ddp_avg_hooks as dah
    from ddp_avg_hooks.integrations import torchft as ft

    torch.set_num_threads(1)
    torch.manual_seed(0)  # every replica group starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # the replica group's own process group (one process here; torchrun's ranks otherwise)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    timeout = timedelta(seconds=10)
    # the Manager's store: where the replica group's ranks meet (rank 0 hosts it)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1,
        use_async_quorum=False,  # the quorum (and any healing) completes before a round
        init_sync=False,  # the same seed everywhere; torchft's step-0 sync would copy a replica
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    opt.load_state_dict(sd["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
        replica_id=f"replica_{args.replica_id}", lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        hostname="127.0.0.1", timeout=timeout, quorum_timeout=timedelta(seconds=30),
        connect_timeout=timeout)
    open(os.path.join(args.sync_dir, f"ready{args.replica_id}"), "w").close()
    end = time.monotonic() + 120
    while not os.path.exists(os.path.join(args.sync_dir, "go")) and time.monotonic() < end:
        time.sleep(0.05)
    ddp = DistributedDataParallel(model)
    handle = dah.register_averaging_hook(ddp, ft.allreduce_hook, ft.TorchftState(manager),
                                         period=args.period, optimizer=opt)
    averaging = ft.FaultTolerantAveraging(manager, handle)  # runs each round in a quorum
    gen = torch.Generator().manual_seed(100 + args.replica_id)
    w = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
    seen = 0
    for step in range(args.steps):
        if step == args.kill_at:
            print(f"replica {args.replica_id}: killing itself before step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(32, 8, generator=gen)
        loss = F.mse_loss(ddp(x), torch.tanh(x @ w))
        opt.zero_grad()
        loss.backward()
        started = time.monotonic()
        opt.step()  # and the round, when due, inside a quorum
        for rnd in averaging.rounds[seen:]:
            print(f"replica {args.replica_id}: round at step {rnd['step']}: "
                  f"{rnd['participants']} participants, "
                  f"{'committed' if rnd['committed'] else 'discarded'} in "
                  f"{time.monotonic() - started:.2f} s, loss {loss.item():.4f}", flush=True)
        seen = len(averaging.rounds)
    print(f"replica {args.replica_id}: {averaging.committed} rounds committed, "
          f"{averaging.discarded} discarded", flush=True)
    handle.remove()
    manager.shutdown(wait=False)
    time.sleep(0.1)
    os._exit(0)  # torchft's threads: leave without the interpreter's teardown


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("launch", "replica"), default="launch")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--period", type=int, default=4)
    p.add_argument("--kill-replica", type=int, default=-1)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--heartbeat-ms", type=int, default=1000,
                   help="the lighthouse drops a replica whose heartbeat is this late")
    p.add_argument("--replica-id", type=int, default=0)
    p.add_argument("--lighthouse", default=None)
    p.add_argument("--sync-dir", default=None)
    args = p.parse_args()
    if args.role == "replica":
        replica(args)
    else:
        raise SystemExit(launch(args))


if __name__ == "__main__":
    main()
