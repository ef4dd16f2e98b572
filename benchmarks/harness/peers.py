"""Other libraries' local SGD, run by ``train.py`` beside ours: torchft and Accelerate.

- ``torchft_diloco``, ``torchft_streaming_diloco``: ``torchft.local_sgd.DiLoCo`` under a
  ``torchft.Manager``. Every torchrun rank is one torchft *replica group* of one process
  (what fails and recovers together); the ranks average over torchft's reconfigurable
  ``ProcessGroupGloo``, which the Manager rebuilds from each quorum the lighthouse hands
  out. Rank 0 starts the lighthouse (``torchft_lighthouse``, the binary the torchft wheel
  installs) as torchft's README does, on a free port of the address its peers reach it
  at, and stops it at the end. The streaming variant cuts the model into
  ``--fragments`` fragments of whole modules in parameter order, each with its own outer
  optimizer (torchft's own trainer does the same).
- ``accelerate_localsgd``: ``accelerate.local_sgd.LocalSGD`` around a DDP model (its
  ``no_sync()`` keeps gradients local; ``step()`` after each optimizer step averages the
  parameters every ``--period`` steps with ``accelerator.reduce``).

Both schedules differ from ours (PyTorch's ``PeriodicModelAverager``) by one step:
they average after steps ``period``, ``2 * period``, ...; ours after steps ``1``,
``1 + period``, ... .

Nothing here imports torchft or accelerate at module level: a missing package makes its
variants unavailable (:func:`missing`), not this module unimportable.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

if __package__:
    from .variants import VARIANTS
else:  # run by train.py as a script: this folder is sys.path[0]
    from variants import VARIANTS

INSTALL = "pip install 'ddp_avg_hooks[peers]'"


def lighthouse_binary() -> str | None:
    """``torchft_lighthouse`` next to this interpreter (a venv's bin/), else on ``PATH``."""
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("torchft_lighthouse")


def missing(name: str) -> str | None:
    """Why variant ``name`` cannot run here, or ``None`` when it can."""
    spec = VARIANTS[name]
    for mod in spec.needs:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # an ImportError, or a broken build failing on import
            return f"needs {mod} ({type(exc).__name__}: {exc}); {INSTALL}"
    if spec.library == "torchft" and lighthouse_binary() is None:
        return f"the torchft_lighthouse binary is not next to {sys.executable} nor on PATH"
    return None


# ------------------------------------------------------------------------- torchft

def reachable_address() -> str:
    """This host's address on the route to the rendezvous host (``MASTER_ADDR``).

    Loopback runs get ``127.0.0.1``; a rank in a network namespace, or on another
    machine, gets the address its peers reach it at. Nothing is sent (a UDP socket's
    ``connect`` only picks the route).
    """
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    family, _, _, _, sockaddr = socket.getaddrinfo(master, 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


class Lighthouse:
    """A ``torchft_lighthouse`` subprocess on a free port of ``host``; :meth:`stop` ends it.

    It shares its parent's process group (a launcher that kills the training's process
    tree kills it too) and logs to a temporary file that nobody has to drain.
    """

    _LISTENING = re.compile(r"Lighthouse listening on: \S+:(\d+)")

    def __init__(self, host: str, min_replicas: int, *, join_timeout_ms: int = 1000,
                 quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5000,
                 start_timeout_s: float = 30.0) -> None:
        binary = lighthouse_binary()
        if binary is None:
            raise RuntimeError("torchft_lighthouse not found")
        bind = f"[{host}]:0" if ":" in host else f"{host}:0"
        self.log = tempfile.NamedTemporaryFile(prefix="torchft_lighthouse_", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [binary, "--min_replicas", str(min_replicas), "--bind", bind,
             "--join_timeout_ms", str(join_timeout_ms), "--quorum_tick_ms", str(quorum_tick_ms),
             "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + start_timeout_s
        while True:
            with open(self.log.name, errors="replace") as f:
                m = self._LISTENING.search(f.read())
            if m:
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                with open(self.log.name, errors="replace") as f:
                    raise RuntimeError(f"torchft_lighthouse did not start: {f.read()[-2000:]}")
            time.sleep(0.05)
        host_part = f"[{host}]" if ":" in host else host
        self.address = f"http://{host_part}:{m.group(1)}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            os.remove(self.log.name)


def module_fragments(model: nn.Module, k: int) -> list[nn.Module]:
    """``model``'s parameters cut into ``k`` contiguous fragments of near-equal size, in
    parameter order, at the boundaries of the modules that hold them (torchft's DiLoCo
    takes fragments as modules): each fragment is an ``nn.ModuleList`` of those modules.

    A module whose parameters all belong to earlier modules (a tied output head) is left
    out, so that no parameter is in two fragments (two outer optimizers would step it).

    >>> m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 8))
    >>> [sum(p.numel() for p in f.parameters()) for f in module_fragments(m, 2)]
    [48, 40]
    >>> [sum(p.numel() for p in f.parameters()) for f in module_fragments(m, 4)]
    [20, 20, 8, 40]
    """
    leaves, seen = [], set()
    for m in model.modules():  # pre-order: the order of model.parameters()
        mine = list(m.parameters(recurse=False))
        own = [p for p in mine if id(p) not in seen]
        if own and len(own) != len(mine):
            raise ValueError(f"{type(m).__name__} shares some of its parameters with an earlier "
                             "module: it cannot go in one fragment alone")
        if own:
            leaves.append((m, sum(p.numel() for p in own)))
            seen.update(id(p) for p in own)
    if not 1 <= k <= len(leaves):
        raise ValueError(f"{k} fragments of a model whose parameters are in {len(leaves)} modules")
    total = sum(n for _, n in leaves)
    frags, cur, acc = [], [], 0
    for i, (m, n) in enumerate(leaves):
        after = k - len(frags) - 1          # fragments still to start after the current one
        target = total * (len(frags) + 1) / k
        # cut before m if the rest is needed one module per fragment, or if stopping here
        # lands nearer the fragment's share than taking m does
        if cur and after and (len(leaves) - i == after or acc + n - target > target - acc):
            frags.append(nn.ModuleList(cur))
            cur = []
        cur.append(m)
        acc += n
    frags.append(nn.ModuleList(cur))
    return frags


class TorchftDiLoCo:
    """torchft's DiLoCo on ``model``, with ``opt`` (already built) as the inner optimizer.

    ``after_step()`` says whether the optimizer step just taken ended with a committed
    sync; :meth:`take_comm_s` the seconds DiLoCo's step post-hook spent syncing (quorum,
    all-reduces, commit, outer step); :attr:`bytes` the bytes handed to the Manager's
    all-reduce. Call :meth:`close` on every rank at the end.
    """

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, args, fragments: int,
                 count_bytes, replica=None) -> None:
        """``replica``: an FSDP2 model's meshes (``train.Shards``): each replica group of
        ``replica.shards`` ranks is one torchft replica (one Manager per rank, the group's
        store on its first rank); ``None``: every rank is a replica of its own."""
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        if args.warmup:
            raise ValueError("torchft's DiLoCo has no warm-up of gradient averaging: "
                             "run it with --warmup 0")
        rank, world = dist.get_rank(), dist.get_world_size()
        if replica is None:
            group, group_rank, group_world, replicas, replica_id = None, 0, 1, world, rank
        else:
            group, group_rank = replica.group, dist.get_rank(replica.group)
            group_world, replicas, replica_id = replica.shards, replica.replicas, replica.replica
        timeout = timedelta(seconds=args.timeout)
        host = reachable_address()
        self.lighthouse = Lighthouse(host, min_replicas=replicas) if rank == 0 else None
        box = [self.lighthouse.address if self.lighthouse else None]
        dist.broadcast_object_list(box, src=0)
        # this replica group's store, on its first rank (the Manager finds its server's
        # address there; the store of the quorum's first replica also rendezvouses the
        # cross-replica gloo)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timeout) if group_rank == 0 else None
        where = [(host, self.store.port) if self.store else None]
        if group is not None:
            dist.broadcast_object_list(where, group=group, group_src=0)
        store_host, store_port = where[0]

        def state_dict():
            return {"model": model.state_dict(), "optim": opt.state_dict()}

        def load_state_dict(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
            state_dict=state_dict, min_replica_size=replicas, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
            rank=group_rank, world_size=group_world, store_addr=store_host,
            store_port=store_port, lighthouse_addr=box[0], replica_id=f"bench_{replica_id}",
            hostname=host,
            init_sync=False)  # the same seed: every replica starts from the same weights
        allreduce = self.manager.allreduce

        def counted_allreduce(tensor, *a, **kw):
            count_bytes(tensor.numel() * tensor.element_size())
            return allreduce(tensor, *a, **kw)
        self.manager.allreduce = counted_allreduce

        frags = [model] if fragments <= 1 else module_fragments(model, fragments)
        outer = [torch.optim.SGD(f.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                                 nesterov=args.outer_momentum > 0) for f in frags]
        self._t_hook = 0.0
        self._comm_s = 0.0
        # timing post-hooks on either side of DiLoCo's (hooks run in registration order)
        self._hooks = [opt.register_step_post_hook(self._before_diloco)]
        self.diloco = DiLoCo(self.manager, frags, opt, outer if len(outer) > 1 else outer[0],
                             sync_every=args.period, pin_memory=False)
        self.diloco.__enter__()
        self._hooks.append(opt.register_step_post_hook(self._after_diloco))
        self._committed = self.manager.current_step()

    def _before_diloco(self, *_):
        self._t_hook = time.perf_counter()

    def _after_diloco(self, *_):
        if self.manager.current_step() != self._committed:
            self._comm_s += time.perf_counter() - self._t_hook

    def after_step(self) -> bool:
        now = self.manager.current_step()
        synced, self._committed = now != self._committed, now
        return synced

    def take_comm_s(self) -> float:
        s, self._comm_s = self._comm_s, 0.0
        return s

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.stop()


# ---------------------------------------------------------------------- accelerate

class AccelerateLocalSGD:
    """``accelerate.local_sgd.LocalSGD(accelerator, ddp, local_sgd_steps=period)``, entered."""

    def __init__(self, ddp: nn.Module, args) -> None:
        from accelerate import Accelerator
        from accelerate.local_sgd import LocalSGD

        if args.warmup:
            raise ValueError("accelerate's LocalSGD has no warm-up: run it with --warmup 0")
        # the process group torchrun's ranks already share (gloo on the CPU)
        self.accelerator = Accelerator(cpu=True)
        self.local_sgd = LocalSGD(self.accelerator, ddp, local_sgd_steps=args.period)
        self.local_sgd.__enter__()  # ddp.no_sync() from here on

    def after_step(self) -> bool:
        self.local_sgd.step()
        return self.local_sgd.num_steps % self.local_sgd.local_sgd_steps == 0

    def take_comm_s(self) -> float:
        return 0.0  # its rounds run inside after_step, which the harness times

    def close(self) -> None:
        # leave no_sync() without LocalSGD.__exit__'s extra average (a collective at exit)
        self.local_sgd.model_sync_obj.__exit__(None, None, None)
