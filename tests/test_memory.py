"""``handle.memory_bytes()`` against a count from the sizes of what each hook must hold."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


N = 64 * 32 + 32 + 32 * 8 + 8  # parameters; one bucket, float32
P = 4 * N  # bytes of the parameters


def _report(hook, state, **options):
    ddp = DDP(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    handle = dah.register_averaging_hook(ddp, hook, state, optimizer=opt, **options)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(4, 64)).sum().backward()
        opt.step()  # a round at every step
    report = handle.memory_bytes()
    handle.remove()
    return {kind: per_device.get("cpu", 0) for kind, per_device in report.items()}


def _expect(**kinds):
    return {"bucket_buffers": P, "anchors": 0, "scratch": 0, "residuals": 0, "hook_state": 0,
            "policies": 0, **kinds}


def test_exact_hook_holds_one_buffer(world1):
    assert _report(dah.hooks.allreduce_hook, None) == _expect()


def test_half_hooks_hold_anchor_residual_and_send_buffer(world1):
    # The summed half values are the round's result (applied as anchor - sum): no float
    # buffer; the residual is bfloat16 by default. 2x the parameters in all.
    full = _expect(bucket_buffers=0, anchors=P, scratch=P // 2, residuals=P // 2)
    assert _report(dah.hooks.fp16_compress_hook, None) == full
    assert _report(dah.hooks.bf16_compress_hook, dah.hooks.HalfDeltaState()) == full
    assert sum(full.values()) == 2 * P
    wide = dah.hooks.HalfDeltaState(residual_dtype=None)  # the bucket's dtype: float32
    assert _report(dah.hooks.fp16_compress_hook, wide) == {**full, "residuals": P}
    # without error feedback: only the fp16 delta is sent, nothing is carried
    plain = _expect(bucket_buffers=0, anchors=P, scratch=P // 2)
    no_feedback = dah.hooks.HalfDeltaState(error_feedback=False)
    assert _report(dah.hooks.fp16_compress_hook, no_feedback) == plain


def test_powersgd_counts_its_factors(world1):
    r = 2  # matrices 32 x 64 and 8 x 32 (n x m); the biases are sent exactly, inside P
    p_bytes = 4 * (r * (32 + 8) + 32 + 8)
    q_bytes = 4 * r * (64 + 32)  # each of q, its seed draw q_init, and q_local
    got = _report(dah.hooks.powersgd_hook, dah.hooks.PowerSGDState(matrix_approximation_rank=r,
                                                                    min_compression_rate=0.0))
    assert got == _expect(anchors=P, scratch=q_bytes, residuals=P,
                          hook_state=p_bytes + 2 * q_bytes)


def test_outer_optimizer_and_policies(world1):
    state = dah.hooks.OuterOptimizerState(None)  # SGD with momentum: outer param + momentum
    got = _report(dah.hooks.outer_optimizer(dah.hooks.allreduce_hook), state,
                  optimizer_state="average")
    # the optimizer's momentum buffers are averaged in a policy bucket of their own
    assert got == _expect(anchors=P, hook_state=2 * P, policies=P)


def test_overlap_keeps_a_launch_snapshot(world1):
    got = _report(dah.hooks.allreduce_hook, None, overlap=True)
    assert got == _expect(anchors=P, scratch=P)
    # and of the optimizer state it averages: the momentum's buffer and its snapshot
    got = _report(dah.hooks.allreduce_hook, None, overlap=True, optimizer_state="average")
    assert got == _expect(anchors=P, scratch=P, policies=2 * P)


@pytest.mark.slow
@pytest.mark.parametrize("rounds", [10_000])
def test_memory_does_not_grow_over_many_rounds(world1, rounds):
    ddp = DDP(_model())
    handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook, None)
    handle.average()
    before = handle.memory_bytes()
    for _ in range(rounds):
        handle.step()
    assert handle.memory_bytes() == before and handle.stats.rounds == rounds + 1
    handle.remove()
