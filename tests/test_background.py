"""The background second phase of overlapped int8/int4 rounds (three ranks or more): the
same average as a blocking round, bit for bit, while the training thread issues its own
collectives on the same group; two ranks, whose rounds are one all-gather, likewise; the
registration's background thread keeps the order calls were handed in."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import ParamBucket
from ddp_avg_hooks.collectives import Background
from ddp_avg_hooks.rounds import RoundEngine, run_round
from _dist import run_ranks


def _bucket(rank, index=0):
    g = torch.Generator().manual_seed(10 + index)
    w = torch.nn.Parameter(torch.randn(1000, generator=g))
    b = ParamBucket(index, [w], is_last=True, keep_anchor=True)
    with torch.no_grad():
        w.add_(torch.randn(1000, generator=torch.Generator().manual_seed(rank)).mul_(0.01))
    return b


def _rank_background(rank, world_size, hook_name):
    hook = getattr(dah.hooks, hook_name)
    overlapped = [_bucket(rank, i) for i in range(3)]
    blocking = [_bucket(rank, i) for i in range(3)]
    engine = RoundEngine(hook, None, overlapped)
    rnd = engine.launch(overlapped=True)
    # the training thread's own collective on the same group, right after the launch
    mine = torch.full((4,), float(rank + 1))
    dist.all_reduce(mine)
    engine.finish(rnd)
    run_round(hook, None, blocking)
    # the background thread and the private group: made by a three-rank round only
    return {"user": mine, "overlapped": [b.stored_anchor() for b in overlapped],
            "blocking": [b.stored_anchor() for b in blocking],
            "background": engine.background.in_use}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("hook_name", ["int8_compress_hook", "int4_compress_hook"])
def test_an_overlapped_quantized_round_is_the_blocking_one_bit_for_bit(hook_name, world):
    results = run_ranks(_rank_background, world, timeout_s=60, hook_name=hook_name)
    for r in results:
        # not mixed up with the round's
        assert torch.equal(r["user"], torch.full((4,), float(sum(range(1, world + 1)))))
        for a, b in zip(r["overlapped"], r["blocking"]):
            assert torch.equal(a, b)
        assert r["background"] == (world > 2)
    for other in results[1:]:
        for a, b in zip(results[0]["overlapped"], other["overlapped"]):
            assert torch.equal(a, b)  # the replicas agree on the average


def test_the_background_thread_runs_calls_in_order():
    bg, seen = Background(), []
    for i in range(50):
        bg.submit(lambda i=i: seen.append(i))
    assert bg.drain(timeout=10) and seen == list(range(50))

    def fails():
        raise RuntimeError("reported through the hook's future")

    bg.submit(fails)
    bg.submit(lambda: seen.append("after"))
    assert bg.drain(timeout=10) and seen[-1] == "after"
