"""``offload_state=True``: anchors, residuals and outer optimizer state in host memory,
copied in and out a bucket at a time; results bit-identical to device-resident state,
on 2 gloo ranks (every built-in hook, overlap, checkpoints) and in one process."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import flat, make_model, train_step

h = dah.hooks
HOOKS = {
    "allreduce": lambda: (h.allreduce_hook, None, {}),
    "fp16": lambda: (h.fp16_compress_hook, None, {}),
    "bf16_no_ef": lambda: (h.bf16_compress_hook, h.HalfDeltaState(error_feedback=False), {}),
    "bf16_f32_residual": lambda: (h.bf16_compress_hook, h.HalfDeltaState(residual_dtype=None), {}),
    "powersgd": lambda: (h.powersgd_hook, h.PowerSGDState(matrix_approximation_rank=2), {}),
    "int8": lambda: (h.int8_compress_hook, h.QuantizedDeltaState(block_size=16), {}),
    "diloco_fp16": lambda: (h.outer_optimizer(h.fp16_compress_hook),
                            h.OuterOptimizerState(h.HalfDeltaState()), {}),
    "diloco_adam": lambda: (h.outer_optimizer(h.allreduce_hook),
                            h.OuterOptimizerState(None, torch.optim.Adam, lr=1e-2), {}),
    "fp16_overlap": lambda: (h.fp16_compress_hook, None, {"overlap": True}),
    "fp16_fragments": lambda: (h.fp16_compress_hook, None, {"fragments": 2}),
    "int8_interleaved_fragments": lambda: (h.int8_compress_hook, None, {
        "fragments": 2, "fragment_layout": "interleaved"}),
}


def _build(name, offload):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    hook, state, options = HOOKS[name]()
    handle = dah.register_averaging_hook(ddp, hook, state, period=3, warmup_steps=1,
                                         optimizer=opt, offload_state=offload,
                                         bucket_cap_mb=200 / 2**20, **options)  # two buckets
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    return model, ddp, opt, handle


def _train(rank, name, offload, steps=11):
    model, ddp, opt, handle = _build(name, offload)
    after_rounds = []
    for step in range(steps):
        train_step(ddp, opt, rank, step)
        if name.endswith("overlap"):
            # when an overlapped round lands depends on timing: apply it at once, so
            # both runs apply it at the same step (through the overlapped write-back)
            handle.synchronize()
        if handle.step_count % 3 == 2:  # a round just ran
            after_rounds.append(flat(model))
    handle.synchronize()
    out = {"params": flat(model), "after_rounds": after_rounds, "rounds": handle.stats.rounds,
           "saved": handle.state_dict(), "memory": handle.memory_bytes(),
           "offloaded": {b.offloaded for b in handle.buckets}}
    handle.remove()
    return out


def _assert_same(a, b, where):
    """Equal trees: tensors bit for bit (and on the CPU after a checkpoint), the rest ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], where)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            _assert_same(x, y, where)
    else:
        assert a == b, where


def _rank_parity(rank, world_size):
    return {name: (_train(rank, name, False), _train(rank, name, True)) for name in HOOKS}


def test_offloaded_state_gives_the_same_bits_for_every_hook():
    results = run_ranks(_rank_parity, 2, timeout_s=240)
    for rank in results:
        for name, (device, offloaded) in rank.items():
            assert offloaded["offloaded"] == {True} and device["offloaded"] == {False}
            assert offloaded["rounds"] == device["rounds"] >= 3, name
            for a, b in zip(offloaded["after_rounds"], device["after_rounds"]):
                assert torch.equal(a, b), name
            assert torch.equal(offloaded["params"], device["params"]), name
            for key in ("anchors", "bucket_memory", "hook_state", "step_count", "plan"):
                _assert_same(device["saved"].get(key), offloaded["saved"].get(key), (name, key))
    # the ranks agree after every round (overlapped rounds: on the anchors; a fragment
    # round averages only its fragment, so the whole model is not compared)
    for name in (n for n in HOOKS if not n.endswith("fragments")):
        if name.endswith("overlap"):
            _assert_same(results[0][name][1]["saved"]["anchors"],
                         results[1][name][1]["saved"]["anchors"], name)
            continue
        for a, b in zip(results[0][name][1]["after_rounds"], results[1][name][1]["after_rounds"]):
            assert torch.equal(a, b), name


def test_offloaded_checkpoint_resumes_on_device_and_back(world1):
    def run(offload_first, offload_second):
        model, ddp, opt, handle = _build("diloco_fp16", offload_first)
        for step in range(5):
            train_step(ddp, opt, 0, step)
        saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                 "opt": opt.state_dict(), "avg": handle.state_dict()}
        handle.remove()
        model, ddp, opt, handle = _build("diloco_fp16", offload_second)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        handle.load_state_dict(saved["avg"])
        for step in range(5, 12):
            train_step(ddp, opt, 0, step)
        handle.remove()
        return flat(model)

    reference = run(False, False)
    assert torch.equal(run(True, False), reference)
    assert torch.equal(run(False, True), reference)
    assert torch.equal(run(True, True), reference)


def test_offloaded_anchor_and_residual_are_host_tensors(world1):
    model, ddp, opt, handle = _build("fp16", True)
    for step in range(4):
        train_step(ddp, opt, 0, step)
    for bucket in handle.buckets:
        assert bucket.state_device == torch.device("cpu")
        assert bucket.stored_anchor().device.type == "cpu"
        kinds = [kind for kind, _ in bucket.memory_tensors()]
        # nothing kept on the device between rounds (no staged anchor, no send buffer),
        # and the half hooks need no float buffer
        assert sorted(kinds) == ["anchors", "residuals"], kinds
        residual = bucket.memory()["half_residual"]
        assert residual.device.type == "cpu" and residual.dtype == torch.bfloat16
    handle.remove()


def test_offload_state_excludes_zero_copy(world1):
    with pytest.raises(ValueError, match="zero_copy=True and offload_state=True exclude"):
        dah.register_averaging_hook(DDP(make_model()), h.allreduce_hook, None,
                                    zero_copy=True, offload_state=True)
    with pytest.raises(TypeError, match="offload_state must be True or False"):
        dah.register_averaging_hook(DDP(make_model()), h.allreduce_hook, None, offload_state=1)
