"""The training benchmark's byte meter counts what this rank hands to each collective the
hooks issue, the all-gathers of the int8/int4 rounds included (checked against the hook's
own ``bytes_sent``), and not those an FSDP2 model issues inside its replica group; what
another thread than the training one hands over is counted apart as well."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import ParamBucket
from ddp_avg_hooks.rounds import run_round
from harness.train import CommMeter


@pytest.fixture
def meter():
    """A meter counting on a one-rank gloo group."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    counting = CommMeter()
    counting.install()
    try:
        yield counting
    finally:
        counting.uninstall()
        dist.destroy_process_group()


def test_the_meter_counts_every_collective_a_quantized_round_issues(meter):
    t = torch.zeros(10)
    dist.all_gather_single(torch.empty(10), t)
    dist.all_reduce(t)
    assert meter.bytes == 2 * 40
    meter.bytes = 0
    w = torch.nn.Parameter(torch.ones(1000))
    bucket = ParamBucket(0, [w], is_last=True, keep_anchor=True)
    with torch.no_grad():
        w.add_(torch.linspace(-1, 1, 1000))
    done = run_round(dah.hooks.int8_compress_hook, None, [bucket])
    # the payload, zero-padded to a whole block: what the hook counts, and a few bytes more
    assert done.bytes_sent <= meter.bytes <= done.bytes_sent + 128


def test_collectives_inside_a_skipped_group_are_not_counted(meter):
    inside = dist.new_group([0])  # an FSDP2 replica group's own collectives
    meter.skip_groups.append(inside)
    t = torch.zeros(10)
    dist.all_gather_single(torch.empty(10), t, inside)  # positional group
    dist.all_gather_single(torch.empty(10), t, group=inside)
    dist.all_reduce(t, group=inside)
    assert meter.bytes == 0
    dist.all_gather_single(torch.empty(10), t)  # the default group: across the link
    dist.all_to_all_single(torch.empty(10), t)
    assert meter.bytes == 2 * 40


def test_what_another_thread_hands_over_is_counted_as_background(meter):
    t = torch.zeros(10)
    dist.all_reduce(t)  # the training thread's
    other = threading.Thread(target=lambda: dist.all_gather_single(torch.empty(10), t))
    other.start()
    other.join(timeout=30)
    assert meter.counts() == (80, 40)
