"""Overlapped rounds of different fragments stay in flight together; a round is applied
once complete, and at the latest before the next round of its own fragment (of any
fragment with fragments=1 or a collective observer). A one-rank world in this process,
with a hook whose futures the test completes by hand."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah


class HeldHook:
    """Its futures complete when the test releases them (the bucket's own values)."""

    def __init__(self) -> None:
        self.held: list[tuple[int, torch.futures.Future, torch.Tensor]] = []

    def __call__(self, state, bucket):
        fut = torch.futures.Future()
        self.held.append((bucket.index(), fut, bucket.buffer().clone()))
        return fut

    def release(self, index: int | None = None) -> None:
        for i, fut, value in self.held:
            if not fut.done() and (index is None or i == index):
                fut.set_result(value)


def _register(hook, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))
    cap = 6 * 7 * 4 / 2**20  # one Linear per bucket, one bucket per fragment
    return dah.register_averaging_hook(DDP(model), hook, None, period=2, fragments=2,
                                       overlap=True, bucket_cap_mb=cap, **kw)


def test_rounds_of_other_fragments_launch_while_one_is_in_flight(world1):
    hook = HeldHook()
    handle = _register(hook)
    handle.step()  # step 0: fragment 0 launched
    handle.step()  # step 1: fragment 1 launched beside it
    assert [b for b, _, _ in hook.held] == [0, 1]
    assert len(handle.rounds_in_flight) == 2 and handle.stats.rounds == 0
    first = handle.rounds_in_flight[0]  # fragment 0's: only its own fragment's next round waits
    assert handle.must_finish_before(first, 0) and not handle.must_finish_before(first, 1)
    hook.release(1)
    hook.release(0)
    handle.step()  # step 2: both complete, applied; fragment 0 launched again
    assert handle.stats.rounds == 2 and len(handle.rounds_in_flight) == 1
    hook.release()
    handle.synchronize()
    assert handle.stats.rounds == 3 and not handle.rounds_in_flight


def test_a_fragment_waits_for_its_own_last_round(world1):
    hook = HeldHook()
    handle = _register(hook)
    handle.step(), handle.step()  # fragments 0 and 1 in flight, nothing released
    # step 2 launches fragment 0 again: its last round must be applied first (it waits),
    # fragment 1's stays in flight
    threading.Timer(0.2, hook.release, args=(0,)).start()
    handle.step()
    assert handle.stats.rounds == 1
    assert [p.fragment for p in handle.rounds_in_flight] == [1, 0]
    hook.release()
    handle.synchronize()


@pytest.mark.parametrize("option", ["verify", "track_consensus"])
def test_collective_observers_finish_every_round_before_the_next(world1, option):
    hook = HeldHook()
    handle = _register(hook, **{option: True})
    handle.step()
    threading.Timer(0.2, hook.release, args=(0,)).start()
    handle.step()  # fragment 1's round: fragment 0's is applied first
    assert handle.stats.rounds == 1 and [p.fragment for p in handle.rounds_in_flight] == [1]
    hook.release()
    handle.synchronize()
