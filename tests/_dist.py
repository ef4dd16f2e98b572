"""Run a function on several gloo ranks in fresh processes, with deadlines so nothing can hang.

``run_ranks(fn, world_size, **kw)`` starts ``world_size`` processes on 127.0.0.1 with
an OS-chosen port, runs ``fn(rank, world_size, **kw)`` in each after
``init_process_group`` (with a process-group timeout), and returns the per-rank
results (loaded through files: tensors on an mp queue die with their process).
A rank leaves with ``os._exit(0)`` right after saving its result and destroying its
process group (with ``hard_exit=True``, for fault tests, without destroying it). A
failing rank re-raises in the parent; ranks still running at the deadline are
killed and ``TimeoutError`` is raised.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PG_TIMEOUT_S = float(os.environ.get("DAH_TEST_PG_TIMEOUT", "20"))

# Ranks are forked from a forkserver (one per pytest process) that has imported torch
# once, instead of each spawned rank importing it again: `import torch` plus the
# torch._dynamo import of the first DDP construction cost ~6 s of CPU a rank on a
# 2-core machine, with a few-step rank function taking well under a second. As far as a
# test can tell a rank still starts fresh: nothing but these imports happened in the
# forkserver, and a rank takes the parent's current environment (os.environ at the
# call, plus ``env``) before it unpickles fn and kw, so the test module and
# ddp_avg_hooks are imported in the rank, under that environment, as with spawn.
# DAH_TEST_START_METHOD=spawn brings back one interpreter per rank.
START_METHOD = os.environ.get("DAH_TEST_START_METHOD", "forkserver")
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "torch.nn.parallel",
            "torch._dynamo", "pytest"]


def run_ranks(fn, world_size: int = 2, timeout_s: float = 120.0, pg_timeout_s: float | None = None,
              env: dict | None = None, missing_ok: bool = False, hard_exit: bool = False, **kw):
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    out = tempfile.mkdtemp(prefix="dah_ranks_")
    pg_timeout = PG_TIMEOUT_S if pg_timeout_s is None else pg_timeout_s
    if START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)
    payload = pickle.dumps((fn, kw))
    try:
        ctx = mp.start_processes(
            _entry,
            args=(payload, world_size, store.port, out, pg_timeout,
                  {**os.environ, **(env or {})}, hard_exit),
            nprocs=world_size,
            join=False,
            start_method=START_METHOD,
        )
        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{getattr(fn, '__name__', fn)}: "
                                   f"ranks still running after {timeout_s}s")
        paths = [os.path.join(out, f"rank{r}.pt") for r in range(world_size)]
        # missing_ok: a rank that exits early on purpose (a simulated crash) returns None
        return [torch.load(p, weights_only=False) if (os.path.exists(p) or not missing_ok) else None
                for p in paths]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        del store


def _entry(rank, payload, world_size, port, out, pg_timeout, env, hard_exit):
    # What the rank inherited from the forkserver (torch's ~300k objects) stays out of
    # garbage collection: a full collection (the one before destroy_process_group below,
    # or an automatic one) would walk it all (0.25 s) and, by touching every object,
    # copy the forkserver's whole heap into this process.
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)
    fn, kw = pickle.loads(payload)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                          timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout))
    try:
        result = fn(rank, world_size, **kw)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        dist.destroy_process_group()
        raise  # spawn records the traceback for the parent
    del result
    if not hard_exit:
        # After a peer crashed, gloo may abort while tearing down the broken group:
        # fault tests skip the teardown. Otherwise drop what the rank built (DDP
        # reducers hold the group) before destroying the group.
        gc.collect()
        dist.destroy_process_group()
    # The result is saved: leave without interpreter teardown, where c10d/gloo
    # destructors have been seen to abort ("terminate called without an active
    # exception") in torch 2.13 after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
