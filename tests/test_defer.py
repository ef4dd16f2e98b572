"""``ParamBucket.defer``: a hook's second phase runs once every bucket of the round has
been launched, on the training thread, in bucket order; a failure fails the round.

A one-rank world in this process; the two-rank behaviour of the hooks that use it
(``int8_compress_hook``, ``int4_compress_hook``) is checked in test_quantized_hooks.py.
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

    ``log`` gets ("hook", bucket) and ("phase2", bucket, thread) entries.
    """

    def __init__(self, fail_bucket: int | None = None) -> None:
        self.log, self.fail_bucket = [], fail_bucket

    def __call__(self, state, bucket: ParamBucket) -> torch.futures.Future:
        values = bucket.buffer().clone()
        fut = torch.futures.Future()
        self.log.append(("hook", bucket.index()))

        def phase2() -> None:
            self.log.append(("phase2", bucket.index(), threading.get_ident()))
            if bucket.index() == self.fail_bucket:
                raise RuntimeError("second phase broke")
            fut.set_result(values)

        bucket.defer(phase2)
        return fut


def _register(hook, **kw):
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)))
    cap = 8 * 9 * 4 / 2**20  # one Linear per bucket: two buckets
    handle = dah.register_averaging_hook(ddp, hook, None, period=4, bucket_cap_mb=cap, **kw)
    assert len(handle.buckets) == 2
    return ddp, handle


@pytest.mark.parametrize("overlap", [False, True])
def test_second_phases_run_after_every_bucket_is_launched(world1, overlap):
    hook = TwoPhaseHook()
    _, handle = _register(hook, overlap=overlap)
    assert handle.step()  # step 0: a round
    me = threading.get_ident()
    assert hook.log == [("hook", 0), ("hook", 1), ("phase2", 0, me), ("phase2", 1, me)]
    for _ in range(4):
        handle.step()
    handle.synchronize()
    assert handle.stats.rounds == 2 and len(hook.log) == 8


def test_a_failing_second_phase_fails_the_round_and_changes_nothing(world1):
    hook = TwoPhaseHook(fail_bucket=0)
    ddp, handle = _register(hook)
    before = [p.detach().clone() for p in ddp.parameters()]
    with pytest.raises(AveragingHookError, match=r"bucket 0 of 2 .*deferred call raised "
                                                 r"RuntimeError: second phase broke"):
        handle.step()
    # bucket 1's second phase still ran: its collectives must be issued on every rank
    assert [e[:2] for e in hook.log if e[0] == "phase2"] == [("phase2", 0), ("phase2", 1)]
    assert all(torch.equal(p.detach(), b) for p, b in zip(ddp.parameters(), before))


def test_a_hook_called_by_hand_runs_the_deferred_call_at_once():
    bucket = ParamBucket(0, [torch.nn.Parameter(torch.ones(3))], is_last=True)
    fut = TwoPhaseHook()(None, bucket)
    assert fut.done() and fut.wait().tolist() == [1.0, 1.0, 1.0]


def test_run_round_runs_second_phases_before_between(world1):
    hook, order = TwoPhaseHook(), []
    buckets = [ParamBucket(i, [torch.nn.Parameter(torch.ones(2))], is_last=i == 1)
               for i in range(2)]
    dah.rounds.run_round(hook, None, buckets, between=lambda: order.append(len(hook.log)))
    assert order == [4]  # both hooks and both second phases had run
