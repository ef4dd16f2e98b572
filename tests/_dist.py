"""Run a function on several gloo ranks in fresh processes, with deadlines so nothing can hang.

``run_ranks(fn, world_size, **kw)`` starts ``world_size`` processes on 127.0.0.1 with
an OS-chosen port, runs ``fn(rank, world_size, **kw)`` in each after
``init_process_group`` (with a process-group timeout), and returns the per-rank
results (loaded through files: tensors on an mp queue die with their process).
A rank leaves with ``os._exit(0)`` right after saving its result and destroying its
process group (with ``hard_exit=True``, for fault tests, without destroying it). A
failing rank re-raises in the parent; ranks still running at the deadline are
killed and ``TimeoutError`` is raised.

``run_script(script, argv, nproc)`` runs a script file on forked ranks as torchrun
would, for the benchmark harness's tests (see its docstring).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import runpy
import shutil
import sys
import tempfile
import time
import traceback
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
    store = _store(world_size, timeout_s)
    out = tempfile.mkdtemp(prefix="dah_ranks_")
    pg_timeout = PG_TIMEOUT_S if pg_timeout_s is None else pg_timeout_s
    payload = pickle.dumps((fn, kw))
    try:
        _start_and_wait(_entry, (payload, world_size, store.port, out, pg_timeout,
                                 {**os.environ, **(env or {})}, hard_exit),
                        world_size, timeout_s, getattr(fn, "__name__", fn), exit_codes=False)
        paths = [os.path.join(out, f"rank{r}.pt") for r in range(world_size)]
        # missing_ok: a rank that exits early on purpose (a simulated crash) returns None
        return [torch.load(p, weights_only=False) if (os.path.exists(p) or not missing_ok) else None
                for p in paths]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        del store


def run_script(script: str, argv: list[str], nproc: int = 2, timeout_s: float = 120.0,
               log: str | None = None, env: dict | None = None) -> list[int]:
    """Run ``script`` as ``torchrun --standalone --nproc-per-node nproc script *argv`` would,
    on ranks forked from the forkserver; returns their exit codes.

    Each rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a store held here, as
    torchrun's agent holds one) and runs the file as ``__main__`` with ``sys.argv`` set,
    its output appended to ``log``. For scripts whose own behaviour is under test, not
    torchrun's: it saves each launch the ~5 s of imports a fresh rank spends.
    """
    store = _store(nproc, timeout_s)
    try:
        return _start_and_wait(_script_entry, (script, list(argv), nproc, store.port, log,
                                               {**os.environ, **(env or {})}),
                               nproc, timeout_s, os.path.basename(script), exit_codes=True)
    finally:
        del store


def _store(world_size: int, timeout_s: float):
    return dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def _start_and_wait(entry, args: tuple, world_size: int, timeout_s: float, name, *,
                    exit_codes: bool) -> list[int]:
    """Start ``entry(rank, *args)`` on ``world_size`` ranks; wait for them all, or kill
    them at the deadline and raise ``TimeoutError``. A rank that raised or exited with
    an error re-raises here, unless ``exit_codes``: then the ranks' exit codes are the
    result (torch stops the other ranks when one fails, as torchrun does)."""
    if START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)
    ctx = mp.start_processes(entry, args=args, nprocs=world_size, join=False,
                             start_method=START_METHOD)
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=0.5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{name}: ranks still running after {timeout_s}s")
    except mp.ProcessExitedException:
        if not exit_codes:
            raise
    return [p.exitcode for p in ctx.processes]


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


def _script_entry(rank, script, argv, world_size, port, log, env):
    gc.freeze()  # as in _entry
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        ROLE_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        # init_process_group connects to the store held by run_script, as torchrun's
        # workers connect to their agent's
        TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))
