"""``ParamBucket`` and its storage objects, in one process, against plain tensor math.

Every placement (device, host memory, zero copy) must hold the same values, write the
parameters in place, and refuse what it cannot do with the same message.
"""

from __future__ import annotations

import functools

import pytest
import torch

from ddp_avg_hooks import ops
from ddp_avg_hooks.bucket import BucketRound, ParamBucket, assign_buckets
from ddp_avg_hooks import storage as storage_module
from ddp_avg_hooks.storage import DeviceStorage, HostStorage, ZeroCopyStorage

STORAGES = {"device": DeviceStorage, "host": HostStorage, "zero_copy": ZeroCopyStorage,
            "zero_copy_copy": functools.partial(ZeroCopyStorage, in_place=False)}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g))]


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _move(params, by: float) -> None:
    with torch.no_grad():
        for i, p in enumerate(params):
            p.add_(by * (i + 1))


@pytest.mark.parametrize("storage", STORAGES)
def test_buffer_anchor_and_delta_follow_the_parameters(storage):
    ps = _params()
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=STORAGES[storage])
    start = _flat(ps)
    assert b.numel() == 17 and b.dtype == torch.float32
    assert torch.equal(b.buffer(), start) and torch.equal(b.anchor(), start)
    _move(ps, 0.25)
    assert torch.equal(b.delta(), start - _flat(ps))
    assert torch.equal(b.delta(torch.float16, scale=0.5), ((start - _flat(ps)) * 0.5).half())
    assert torch.equal(b.stored_anchor(), start)
    assert b.stored_anchor().device == b.state_device


@pytest.mark.parametrize("storage", ["device", "host"])
def test_a_bucket_without_anchor_refuses_every_anchor_use(storage):
    b = ParamBucket(0, _params(), is_last=True, storage=STORAGES[storage])
    assert not b.has_anchor()
    for use in (b.anchor, b.stored_anchor, b.delta, b.mark_result_as_delta):
        with pytest.raises(RuntimeError, match="bucket 0 keeps no anchor"):
            use()
    with pytest.raises(RuntimeError, match="weighted round needs an anchor"):
        b.begin_round(0.5)


def test_scaled_buffer_is_one_rounding_of_params_times_scale():
    ps = _params()
    b = ParamBucket(0, ps, is_last=True)
    assert torch.equal(b.scaled_buffer(1 / 3), _flat(ps) * (1 / 3))
    assert torch.equal(b.scaled_buffer(0.25), _flat(ps).div(4))


def test_a_weighted_round_shows_the_scaled_change():
    ps = _params()
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True)
    anchor = _flat(ps)
    _move(ps, 1.0)
    b.begin_round(0.5)
    torch.testing.assert_close(b.buffer(), anchor + 0.5 * (_flat(ps) - anchor), rtol=0, atol=1e-6)
    torch.testing.assert_close(b.delta(), 0.5 * (anchor - _flat(ps)), rtol=0, atol=1e-6)


def _codes_of(change: torch.Tensor, residual: torch.Tensor | None, bits: int):
    """The reference for ``quantize_delta``: the plain-PyTorch quantizer over a change
    computed here, as ``(anchor - params) * scale`` in the compute dtype."""
    from ddp_avg_hooks import _quantize
    layout = ops.QuantLayout.for_bucket(change.numel(), 1, 8, bits)
    packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    _quantize.quantize_blocks(change, packed, layout, residual, residual)
    return layout, packed


@pytest.mark.parametrize("storage", ["device", "host"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("weight", [1.0, 0.75])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_delta_codes_the_change_of_the_parameters(storage, dtype, weight, bits):
    """Overlapped (from the launch snapshot, in one pass) or not, weighted or not, the
    codes and the residual are the reference quantizer's over the change, bit for bit;
    a blocking round after an overlapped one reads the parameters, not the stale snapshot."""
    ps = [p.detach().to(dtype).requires_grad_() for p in _params()]
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=STORAGES[storage])
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    anchor = _flat(ps).to(ct)
    for by, overlapped in ((0.37, True), (-0.5, False)):
        _move(ps, by)
        b.begin_round(weight, overlapped=overlapped)
        change = (anchor - _flat(ps).to(ct)) * (0.5 * weight)
        residual = torch.linspace(-1e-3, 1e-3, 17, dtype=ct)
        layout, want = _codes_of(change, want_res := residual.clone(), bits)
        packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        b.quantize_delta(packed, layout, scale=0.5, residual=residual)
        assert torch.equal(packed, want), (overlapped, "codes")
        assert torch.equal(residual, want_res), (overlapped, "residual")
        b.apply(b.anchor().clone(), overlapped=overlapped)  # the anchor stays, params follow
        anchor = _flat(ps).to(ct) if not overlapped else anchor


def test_quantize_delta_without_anchor_or_residual():
    ps = _params()
    layout = ops.QuantLayout.for_bucket(17, 1, 8, 4)
    packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    b = ParamBucket(0, ps, is_last=True)
    b.begin_round(overlapped=True)
    with pytest.raises(RuntimeError, match="bucket 0 keeps no anchor"):
        b.quantize_delta(packed, layout)
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True)
    start = _flat(ps)
    b.begin_round(overlapped=True)
    _move(ps, 0.5)  # after the launch: the round's change is the launch's, zero
    b.quantize_delta(packed, layout)
    assert not ops.dequantize_blocks(packed, layout, torch.empty(17)).any()
    assert torch.equal(b.anchor(), start)


@pytest.mark.parametrize("storage", STORAGES)
def test_apply_writes_in_place_and_the_anchor_follows(storage):
    ps = _params()
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=STORAGES[storage])
    ptrs = [p.data_ptr() for p in ps]
    new = torch.arange(17, dtype=torch.float64)
    b.begin_round()
    b.apply(new)
    assert torch.equal(_flat(ps), new.float()) and torch.equal(b.stored_anchor(), new.float())
    assert [p.data_ptr() for p in ps] == ptrs
    # a change: params <- anchor - change
    b.begin_round()
    b.apply(torch.full((17,), 0.5, dtype=torch.float16), is_delta=True)
    assert torch.equal(_flat(ps), new.float() - 0.5) and torch.equal(b.stored_anchor(), _flat(ps))


@pytest.mark.parametrize("storage", ["device", "host"])
@pytest.mark.parametrize("mixing", [None, 0.25])
def test_an_overlapped_round_keeps_the_progress_made_meanwhile(storage, mixing):
    ps = _params()
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=STORAGES[storage])
    b.begin_round(overlapped=True)
    launch = _flat(ps)
    _move(ps, 0.5)  # local steps while the round is in flight
    now = _flat(ps)
    averaged = launch + 1.0
    b.apply(averaged.clone(), overlapped=True, mixing=mixing)
    expected = (now + (averaged - launch) if mixing is None
                else mixing * now + (1 - mixing) * averaged)
    torch.testing.assert_close(_flat(ps), expected, rtol=0, atol=1e-6)
    assert torch.equal(b.stored_anchor(), averaged)


@pytest.mark.parametrize("storage", list(STORAGES))
def test_an_overlapped_result_in_the_workspace_becomes_the_anchor_without_sharing_memory(
        storage):
    # two rounds in a row whose results the hook wrote into bucket.workspace(): each
    # keeps the progress made meanwhile, the anchor takes the result's bits, and the next
    # workspace is never the anchor's memory (a hook that fills it before it reads the
    # anchor must not change the anchor)
    ps = _params()
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=STORAGES[storage])
    held = []
    for step in range(3):
        b.begin_round(overlapped=True)
        launch = _flat(ps)
        _move(ps, 0.5 + step)
        now = _flat(ps)
        anchor = b.stored_anchor().clone()
        out = b.workspace()
        assert out.untyped_storage().data_ptr() != b.stored_anchor().untyped_storage().data_ptr()
        out.fill_(float("nan"))  # the hook's scratch use, before it reads the anchor
        assert torch.equal(b.anchor(), anchor)
        averaged = (launch + anchor) / 2 + step
        out.copy_(averaged)
        b.apply(out, overlapped=True)
        assert torch.equal(_flat(ps), now + (averaged - launch))
        assert torch.equal(b.stored_anchor(), averaged)
        held.append(sorted((k, t.numel()) for k, t in b.memory_tensors()))
        assert held[-1] == held[0]  # the same buffers, none made again
    fresh = torch.full((b.numel(),), 2.0)  # not the workspace: the anchor copies it
    b.begin_round(overlapped=True)
    b.apply(fresh, overlapped=True)
    assert torch.equal(b.stored_anchor(), fresh)
    assert b.stored_anchor().data_ptr() != fresh.data_ptr()


@pytest.mark.parametrize("device, on_host", [
    ("cpu", True), ("cpu", False),  # False: an accelerator's path (no host sync), on the CPU
    pytest.param("cuda", None, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="no CUDA device"))])
def test_an_overlapped_round_keeps_a_nonnegative_tensor_no_lower_than_its_value_or_average(
        monkeypatch, device, on_host):
    if on_host is not None:
        monkeypatch.setattr(storage_module, "_decides_on_host", lambda device: on_host)
    second_moment = torch.nn.Parameter(torch.tensor([4.0, 1.0, 0.0], device=device))
    momentum = torch.nn.Parameter(torch.tensor([1.0, -2.0], device=device))
    ps = [second_moment, momentum]
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=DeviceStorage)
    b.begin_round(overlapped=True)
    launch = _flat(ps)
    with torch.no_grad():  # decays while the round is in flight
        second_moment.mul_(0.1)
        momentum.mul_(0.1)
    now = _flat(ps)
    averaged = torch.tensor([1.0, 3.0, 0.0, 3.0, -4.0], device=device)
    b.apply(averaged.clone(), overlapped=True, keep_nonnegative=True)
    plain = now + (averaged - launch)  # [-2.6, 2.1, 0, 2.1, -2.2]
    # the nonnegative tensor: no lower than min(its value, its average) = [0.4, 0.1, 0]
    floor = torch.minimum(now[:3], averaged[:3])
    expected = torch.cat([torch.maximum(plain[:3], floor), plain[3:]])
    torch.testing.assert_close(_flat(ps), expected, rtol=0, atol=1e-6)
    assert _flat(ps)[0].item() == pytest.approx(0.4) and _flat(ps)[3:].tolist() == pytest.approx(
        [2.1, -2.2])  # a tensor that held a negative value keeps the plain rule
    assert torch.equal(b.stored_anchor(), averaged)


def test_host_storage_gives_the_device_storages_bits():
    def run(storage):
        ps = _params()
        b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=storage)
        residual = b.new_state(torch.bfloat16)
        for r in range(3):
            _move(ps, 0.1 * (r + 1))
            b.begin_round()
            half = b.delta(torch.float16, scale=0.5, residual=residual).clone()
            b.mark_result_as_delta()
            b.apply(half, is_delta=True)
        return _flat(ps), residual.clone(), b.stored_anchor().clone()

    for got, want in zip(run(HostStorage), run(DeviceStorage)):
        assert torch.equal(got, want)
    ps = _params()
    host = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=HostStorage)
    assert host.offloaded and host.state_device.type == "cpu"
    assert host.new_state().device.type == "cpu"


def test_zero_copy_parameters_are_views_of_the_buffer():
    ps = _params()
    values = _flat(ps)
    b = ParamBucket(0, ps, is_last=True, storage=ZeroCopyStorage)
    assert torch.equal(_flat(ps), values)  # the values survive the move
    assert ps[1].data_ptr() == b.buffer().data_ptr() + 12 * 4
    b.buffer().mul_(2)  # in place: the hook works on the parameters themselves
    assert torch.equal(_flat(ps), values * 2)
    assert b.workspace().data_ptr() != b.buffer().data_ptr()
    copy = ParamBucket(0, _params(), is_last=True, storage=STORAGES["zero_copy_copy"])
    copy.buffer().mul_(2)  # a copy: nothing changes until the result is written
    assert torch.equal(_flat(copy.parameters()), values)


def test_defer_runs_at_once_outside_a_round_and_after_the_launch_inside():
    b = ParamBucket(0, _params(), is_last=True)
    ran = []
    b.defer(lambda: ran.append("idle"))
    assert ran == ["idle"]
    record = b.begin_round()
    b.defer(lambda: ran.append("round"))
    assert ran == ["idle"]
    for fn in record.take_deferred():
        fn()
    b.defer(lambda: ran.append("late"))  # after the launch: at once
    assert ran == ["idle", "round", "late"]


def test_the_background_goes_with_overlapped_cpu_rounds_and_the_snapshot_with_float32():
    from ddp_avg_hooks.collectives import Background
    b = ParamBucket(0, _params(), is_last=True, keep_anchor=True)
    assert not b.defers_to_background and not b.change_from_snapshot  # outside a round
    b.begin_round(background=Background())  # a blocking round: no thread, live parameters
    assert not b.defers_to_background and not b.change_from_snapshot
    record = b.begin_round(overlapped=True, background=Background())
    assert b.defers_to_background and b.change_from_snapshot
    ran = []
    b.defer(lambda: ran.append(1), background=True)
    assert record.take_background() and not record.take_deferred() and not ran
    assert not b.defers_to_background  # after the launch: deferred calls run at once
    b.begin_round(overlapped=True)  # no background thread given (a bucket by hand)
    assert not b.defers_to_background and b.change_from_snapshot
    half = ParamBucket(0, [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))],
                       is_last=True, keep_anchor=True)
    half.begin_round(overlapped=True, background=Background())
    assert half.defers_to_background and not half.change_from_snapshot  # from live values


def test_a_round_record_holds_the_rounds_facts():
    b = ParamBucket(0, _params(), is_last=True, keep_anchor=True)
    record = b.begin_round(overlapped=True)
    assert isinstance(record, BucketRound) and b.overlapped and not b.result_is_delta
    b.record_sent(torch.zeros(3), torch.zeros(2, dtype=torch.float16))
    b.record_sent(5)  # a byte count
    b.mark_result_as_delta()
    assert record.bytes_sent == 21 and record.result_is_delta and b.result_is_delta
    b.mark_result_as_values()
    assert not record.result_is_delta
    fresh = b.begin_round()
    assert fresh is not record and fresh.bytes_sent == 0 and not b.overlapped


def test_set_buffer_and_workspace():
    ps = _params()
    b = ParamBucket(0, ps, is_last=True)
    b.set_buffer(torch.ones(17, dtype=torch.float64))
    assert torch.equal(b.buffer(), torch.ones(17))  # not reloaded from the parameters
    with pytest.raises(ValueError, match="bucket 0 has 17 elements, got a tensor with 3"):
        b.set_buffer(torch.ones(3))
    b.begin_round()
    b.workspace().fill_(7)
    assert torch.equal(b.buffer(), torch.full((17,), 7.0))


def test_scratch_is_kept_and_made_again_when_its_shape_changes():
    b = ParamBucket(0, _params(), is_last=True)
    s = b.scratch("send", dtype=torch.uint8, numel=9)
    assert s.dtype == torch.uint8 and s.numel() == 9 and not s.any()
    assert b.scratch("send", dtype=torch.uint8, numel=9) is s
    assert b.scratch("send", dtype=torch.uint8, numel=10) is not s
    assert ("scratch", b.scratch("send", dtype=torch.uint8, numel=10)) in list(b.memory_tensors())


@pytest.mark.parametrize("storage", STORAGES)
def test_state_dict_round_trip(storage):
    ps = _params()
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True, storage=STORAGES[storage])
    b.memory()["residual"] = b.new_state(torch.bfloat16).add_(0.5)
    saved = b.state_dict()
    other = ParamBucket(0, _params(seed=1), is_last=True, keep_anchor=True,
                        storage=STORAGES[storage])
    other.check_state(saved)
    other.load_state_dict(saved)
    assert torch.equal(other.stored_anchor(), _flat(ps))
    assert torch.equal(other.memory()["residual"], saved["memory"]["residual"])
    assert other.memory()["residual"].device == other.state_device
    no_anchor = ParamBucket(0, _params(), is_last=True).state_dict()
    with pytest.raises(ValueError, match="bucket 0 keeps an anchor but the checkpoint has none"):
        other.check_state(no_anchor)


def test_memory_tensors_by_kind():
    ps = _params()
    b = ParamBucket(0, ps, is_last=True, keep_anchor=True)
    assert [k for k, _ in b.memory_tensors()] == ["anchors"]  # the buffer is made on first use
    b.buffer()
    b.memory()["r"] = b.new_state()
    assert sorted(k for k, _ in b.memory_tensors()) == ["anchors", "bucket_buffers", "residuals"]
    zero = ParamBucket(0, _params(), is_last=True, storage=ZeroCopyStorage)
    zero.buffer()  # the parameters themselves: not counted
    assert list(zero.memory_tensors()) == []


def test_layout_and_bucket_checks():
    ps = _params()
    b = ParamBucket(3, ps, is_last=False)
    assert b.index() == 3 and not b.is_last()
    assert b.layout() == ("cpu", "torch.float32", ((3, 4), (5,)))
    with pytest.raises(ValueError, match="at least one parameter"):
        ParamBucket(0, [], is_last=True)
    with pytest.raises(ValueError, match="share one device and dtype"):
        ParamBucket(0, [torch.zeros(2), torch.zeros(2, dtype=torch.float64)], is_last=True)
    buckets = assign_buckets(ps, 25, storage=HostStorage, first_index=4, ends=False)
    assert [bk.index() for bk in buckets] == [4] and buckets[0].offloaded
    assert not buckets[0].is_last()
