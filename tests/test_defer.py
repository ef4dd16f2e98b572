"""``ParamBucket.defer``: a hook's second phase runs at the next ``step()``, or when its
round is waited for, on the training thread, in bucket order; a failure fails the round.

A one-rank world in this process; the two-rank behaviour of the hook that uses it
(``int8_compress_hook``) is checked in test_quantized_hooks.py and test_fragments.py.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import ParamBucket
from ddp_avg_hooks.rounds import AveragingHookError


class TwoPhaseHook:
    """Returns an open future; the deferred call completes it with the bucket's values.

    ``log`` gets ("hook", bucket, step) and ("phase2", bucket, step, thread) entries;
    ``step`` is set by the test before each ``handle.step()``.
    """

    def __init__(self, fail_bucket: int | None = None) -> None:
        self.log, self.step, self.fail_bucket = [], None, fail_bucket

    def __call__(self, state, bucket: ParamBucket) -> torch.futures.Future:
        values = bucket.buffer().clone()
        fut = torch.futures.Future()
        self.log.append(("hook", bucket.index(), self.step))

        def phase2() -> None:
            self.log.append(("phase2", bucket.index(), self.step, threading.get_ident()))
            if bucket.index() == self.fail_bucket:
                raise RuntimeError("second phase broke")
            fut.set_result(values)

        bucket.defer(phase2)
        return fut


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _register(hook, **kw):
    ddp = DDP(_model())
    cap = 8 * 9 * 4 / 2**20  # one Linear per bucket: two buckets
    handle = dah.register_averaging_hook(ddp, hook, None, period=4, bucket_cap_mb=cap, **kw)
    assert len(handle.buckets) == 2
    return ddp, handle


def _phase2_steps(hook):
    return [(e[1], e[2]) for e in hook.log if e[0] == "phase2"]


def test_blocking_rounds_run_the_second_phase_when_waited_for(world1):
    hook = TwoPhaseHook()
    _, handle = _register(hook)
    for s in range(5):
        hook.step = s
        handle.step()
    # rounds at steps 0 and 4; both phases within the step, every bucket's hook first
    assert [e[0] for e in hook.log if e[2] == 0] == ["hook", "hook", "phase2", "phase2"]
    assert _phase2_steps(hook) == [(0, 0), (1, 0), (0, 4), (1, 4)]
    assert {e[3] for e in hook.log if e[0] == "phase2"} == {threading.get_ident()}
    assert handle.stats.rounds == 2


def test_overlapped_rounds_run_the_second_phase_at_the_next_step(world1):
    hook = TwoPhaseHook()
    _, handle = _register(hook, overlap=True)
    for s in range(6):
        hook.step = s
        handle.step()
        if s == 0:  # launched, second phase not run yet: the round is not done
            assert handle.stats.rounds == 0 and len(handle._in_flight) == 1
            assert not handle._in_flight[0].done()
        if s == 1:
            assert handle.stats.rounds == 1 and not handle._in_flight
    # launched at steps 0 and 4, second phases at steps 1 and 5, in bucket order
    assert [(e[1], e[2]) for e in hook.log if e[0] == "hook"] == [(0, 0), (1, 0), (0, 4), (1, 4)]
    assert _phase2_steps(hook) == [(0, 1), (1, 1), (0, 5), (1, 5)]
    # a round is applied by the first step() that finds it complete: its future is set
    # by the second phase, so by the step that ran it
    assert handle.stats.rounds == 2


def test_finishing_a_round_early_runs_its_second_phase_first(world1):
    hook = TwoPhaseHook()
    _, handle = _register(hook, overlap=True)
    hook.step = 0
    handle.step()
    hook.step = "state_dict"
    handle.state_dict()  # finishes the round in flight
    assert _phase2_steps(hook) == [(0, "state_dict"), (1, "state_dict")]
    assert handle.stats.rounds == 1


def test_a_failing_second_phase_fails_the_round_and_changes_nothing(world1):
    hook = TwoPhaseHook(fail_bucket=0)
    ddp, handle = _register(hook)
    before = [p.detach().clone() for p in ddp.parameters()]
    hook.step = 0
    with pytest.raises(AveragingHookError, match=r"bucket 0 of 2 .*deferred call raised "
                                                 r"RuntimeError: second phase broke"):
        handle.step()
    # bucket 1's second phase still ran: its collectives must be issued on every rank
    assert _phase2_steps(hook) == [(0, 0), (1, 0)]
    assert all(torch.equal(p.detach(), b) for p, b in zip(ddp.parameters(), before))


def test_a_hook_called_by_hand_runs_the_deferred_call_at_once():
    bucket = ParamBucket(0, [torch.nn.Parameter(torch.ones(3))], is_last=True)
    hook = TwoPhaseHook()
    fut = hook(None, bucket)
    assert fut.done() and fut.wait().tolist() == [1.0, 1.0, 1.0]
