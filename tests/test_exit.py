"""A program that ends with overlapped rounds in flight, without ``handle.remove()``,
exits cleanly: the interpreter's exit waits (a bounded time) for the rounds and the
background thread, so that no thread is inside a torch call as Python finalizes, which
aborts the process ("terminate called without an active exception", exit code 134).
Each program runs in a fresh interpreter, a one-rank world."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.collectives import add_tracked_callback, callbacks_pending, tracked_then
from ddp_avg_hooks.rounds import settle_in_flight

PROGRAM = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import ddp_avg_hooks as dah
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    case = sys.argv[1]
    kw = {}
    if case == "background":  # a round whose background call is inside torch at the end
        def hook(state, bucket):
            fut, value = torch.futures.Future(), bucket.buffer().clone()
            a = torch.randn(1200, 1200)
            def run():
                for _ in range(6):
                    torch.mm(a, a)  # the GIL released, in C++
                fut.set_result(value)
            bucket.defer(run, background=True)
            return fut
    elif case == "never":  # the last round never completes (its peer gone, say)
        dah.rounds.EXIT_WAIT_SECONDS = 0.5
        calls = []
        def hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            if len(calls) < 3:  # the rounds of steps 0 and 2
                fut.set_result(bucket.buffer())
            return fut
    else:  # a built-in hook: int8_compress_hook, allreduce_hook in fragments
        hook = getattr(dah.hooks, case)
        kw = dict(fragments=2, overlap_steps=1) if case == "allreduce_hook" else {}
    def train(keep):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        handle = dah.register_averaging_hook(
            torch.nn.parallel.DistributedDataParallel(model), hook, None, period=2,
            overlap=True, **kw)
        for _ in range(5):
            handle.step()
        assert handle.rounds_in_flight, "the program must end with a round in flight"
        if keep:
            keep.append(handle)
    # a training function that returns drops its handle; a script's handle lives on
    train(None if sys.argv[2] == "dropped" else [])
    import gc; gc.collect()
    print("trained", flush=True)
""")


RELEASE_PROGRAM = textwrap.dedent("""
    import sys, threading, time, torch
    from ddp_avg_hooks.collectives import add_tracked_callback, tracked_then
    class Slow:  # what a callback holds, released slowly (the GIL let go meanwhile)
        def __del__(self):
            time.sleep(0.3)
    slow, fut = Slow(), torch.futures.Future()
    if sys.argv[1] == "then":
        child = tracked_then(fut, lambda f, held=slow: f.value() + 1)
    else:
        add_tracked_callback(fut, lambda f, held=slow: None)
    del slow
    def complete():  # stands for gloo's thread: completes the future, never back in Python
        time.sleep(0.2)
        fut.set_result(1)
        threading.Event().wait()
    threading.Thread(target=complete, daemon=True).start()
    print("trained", flush=True)
""")


def _run_programs(cases: list[str], handle: str = "dropped"
                  ) -> list[tuple[str, subprocess.CompletedProcess]]:
    """Run the program once per case, two at a time; each must end within 120 s.
    ``handle``: ``"dropped"`` (by the training function) or ``"kept"``."""
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    done = []
    for i in range(0, len(cases), 2):
        procs = [(c, subprocess.Popen([sys.executable, "-c", PROGRAM, c, handle], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)) for c in cases[i:i + 2]]
        for case, p in procs:
            out, err = p.communicate(timeout=120)
            done.append((case, subprocess.CompletedProcess(p.args, p.returncode, out, err)))
    return done


@pytest.mark.parametrize("handle", ["dropped", "kept"])
def test_exit_waits_for_a_background_call_inside_torch(handle):
    (_, r), = _run_programs(["background"], handle)
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "still in flight" not in r.stderr


def test_built_in_overlapped_hooks_exit_cleanly_with_a_round_in_flight():
    # without the wait at exit these aborted in most runs (their round's collective or
    # its callback still running as the interpreter finalized)
    runs = _run_programs(["int8_compress_hook"] * 2, "kept") + \
        _run_programs(["int8_compress_hook"] * 2 + ["allreduce_hook"], "dropped")
    for case, r in runs:
        assert r.returncode == 0 and "trained" in r.stdout, (case, r.stderr[-2000:])
        assert "terminate called" not in r.stderr, case


@pytest.mark.parametrize("attach", ["callback", "then"])
def test_what_a_callback_holds_is_released_on_a_thread_of_ours(attach):
    # torch lets the callable go on the thread that ran it, taking the GIL there; had
    # that freed what the callback holds, the exit would no longer wait (the callback
    # returned) while that thread still had Python to run
    r = subprocess.run([sys.executable, "-c", RELEASE_PROGRAM, attach], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr[-2000:]
    assert "terminate called" not in r.stderr


def test_tracked_callbacks_count_until_torch_lets_them_go():
    fut = torch.futures.Future()
    before = callbacks_pending()
    ran = []
    add_tracked_callback(fut, ran.append)
    doubled = tracked_then(fut, lambda f: f.value() * 2)
    failing = tracked_then(fut, lambda f: 1 / 0)
    assert callbacks_pending() == before + 3 and not ran
    fut.set_result(torch.ones(2))
    assert ran == [fut] and doubled.wait().tolist() == [2.0, 2.0]
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        failing.wait()
    assert callbacks_pending() == before


def test_a_round_that_never_completes_is_named_at_exit_after_the_wait():
    started = time.monotonic()
    (_, r), = _run_programs(["never"])
    assert r.returncode == 0 and "trained" in r.stdout, r.stderr[-2000:]
    assert r.stderr.count("1 overlapped round(s) still in flight 0.5 s after the program "
                          "ended") == 1
    assert "handle.remove()" in r.stderr
    assert time.monotonic() - started < 60


class _HeldHook:
    """Its futures complete when the test says so (the bucket's own values)."""

    def __init__(self) -> None:
        self.held: list[tuple[torch.futures.Future, torch.Tensor]] = []

    def __call__(self, state, bucket):
        fut = torch.futures.Future()
        self.held.append((fut, bucket.buffer().clone()))
        return fut


def test_settle_waits_for_the_rounds_in_flight_and_applies_nothing(world1):
    hook = _HeldHook()
    model = torch.nn.Linear(4, 3)
    # rounds other tests of this process left unsettled count too: compare with theirs
    others = settle_in_flight(time.monotonic())
    handle = dah.register_averaging_hook(DDP(model), hook, None, period=2, overlap=True)
    handle.step()
    assert len(handle.rounds_in_flight) == 1
    t0 = time.monotonic()
    assert settle_in_flight(t0 + 0.05) == others + 1  # still in flight at the deadline
    assert time.monotonic() - t0 >= 0.05
    before = [p.detach().clone() for p in model.parameters()]
    for fut, value in hook.held:
        fut.set_result(value.add(1.0))
    assert settle_in_flight(time.monotonic()) == others
    # settled, not applied: the parameters and the stats are as they were
    assert handle.stats.rounds == 0 and len(handle.rounds_in_flight) == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    handle.remove()  # applies it
    assert handle.stats.rounds == 1
    assert all(torch.equal(a + 1.0, b) for a, b in zip(before, model.parameters()))
