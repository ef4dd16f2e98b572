"""Registry behaviour that needs no peers: a world of one gloo rank in this process."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import assign_buckets


def _mlp(*dims, seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(dims, dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


def _assert_unchanged(module, before):
    for p, b in zip(module.parameters(), before):
        assert torch.equal(p.detach(), b)


# --- buckets ------------------------------------------------------------------------
def test_buckets_keep_order_group_by_dtype_and_respect_cap():
    ps = [
        torch.zeros(300),  # 1200 B
        torch.zeros(10, dtype=torch.bfloat16),
        torch.zeros(100),  # 400 B
        torch.zeros(1000),  # 4000 B: larger than the cap, alone
        torch.zeros(5, dtype=torch.bfloat16),
    ]
    cap_mb = 2000 / 2**20
    buckets = assign_buckets(ps, cap_mb)
    groups = [[next(i for i, q in enumerate(ps) if q is p) for p in b.parameters()]
              for b in buckets]
    assert groups == [[0, 2], [1, 4], [3]]
    assert [b.index() for b in buckets] == [0, 1, 2]
    assert [b.is_last() for b in buckets] == [False, False, True]
    assert [b.dtype for b in buckets] == [torch.float32, torch.bfloat16, torch.float32]
    for b in buckets:
        nbytes = b.numel() * b.buffer().element_size()
        assert nbytes <= 2000 or len(b.parameters()) == 1


def test_bucket_flat_order_is_logical_even_for_channels_last():
    p = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 3, 2, 2)
    p = p.contiguous(memory_format=torch.channels_last)
    (b,) = assign_buckets([p], 25, keep_anchor=True)
    assert torch.equal(b.buffer(), p.reshape(-1))
    assert torch.equal(b.anchor(), p.reshape(-1))
    ptr, strides = p.data_ptr(), p.stride()
    b.apply(torch.arange(24, 0, -1, dtype=torch.float64))
    assert p.data_ptr() == ptr and p.stride() == strides
    assert torch.equal(p.reshape(-1), torch.arange(24, 0, -1, dtype=torch.float32))
    assert torch.equal(b.anchor(), p.reshape(-1))


def test_anchor_and_delta_only_when_asked():
    p = torch.nn.Parameter(torch.full((4,), 20.0))
    (plain,) = assign_buckets([p], 25)
    with pytest.raises(RuntimeError, match="needs_anchor"):
        plain.anchor()
    (kept,) = assign_buckets([p], 25, keep_anchor=True)
    with torch.no_grad():
        p.sub_(torch.tensor([0.001, 0.002, 0.003, 0.004]))
    expected = ((torch.full((4,), 20.0) - p.detach()) / 2).to(torch.float16)
    got = kept.delta(torch.float16, scale=0.5)
    assert got.dtype == torch.float16 and torch.equal(got, expected)
    assert kept.delta(torch.float16).data_ptr() == got.data_ptr()  # persistent scratch


# --- register_averaging_hook: arguments ---------------------------------------------
def test_rejects_non_ddp_model(world1):
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        dah.register_averaging_hook(torch.nn.Linear(2, 2), dah.hooks.allreduce_hook, None)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"period": 0}, ValueError, "period must be >= 1"),
        ({"period": 2.0}, TypeError, "period must be an int"),
        ({"warmup_steps": -1}, ValueError, "warmup_steps must be >= 0"),
        ({"bucket_cap_mb": 0}, ValueError, "bucket_cap_mb must be > 0"),
        ({"bucket_cap_mb": -1.5}, ValueError, "bucket_cap_mb must be > 0"),
        ({"optimizer": "sgd"}, TypeError, "optimizer must be"),
        ({"check_finit": True}, TypeError, "unknown option"),
    ],
)
def test_rejects_bad_arguments(world1, kwargs, exc, match):
    ddp = DDP(_mlp(3, 2))
    with pytest.raises(exc, match=match):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, **kwargs)


def test_rejects_bad_hook_and_state(world1):
    ddp = DDP(_mlp(3, 2))
    with pytest.raises(TypeError, match="hook must be callable"):
        dah.register_averaging_hook(ddp, "allreduce", None)
    with pytest.raises(TypeError, match="allreduce_hook: state must be None"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, {"group": 1})


_STATEFUL = {
    "int8": lambda: (dah.hooks.int8_compress_hook, dah.hooks.QuantizedDeltaState()),
    "fp16": lambda: (dah.hooks.fp16_compress_hook, dah.hooks.HalfDeltaState()),
    "powersgd": lambda: (dah.hooks.powersgd_hook,
                         dah.hooks.PowerSGDState(matrix_approximation_rank=1)),
    "outer": lambda: (dah.hooks.outer_optimizer(dah.hooks.int8_compress_hook),
                      dah.hooks.OuterOptimizerState(dah.hooks.QuantizedDeltaState())),
}


def _tensors(tree):
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


@pytest.mark.parametrize("kind", sorted(_STATEFUL))
def test_state_with_memory_serves_one_live_registration(world1, kind):
    hook, state = _STATEFUL[kind]()
    first, second = DDP(_mlp(16, 16, 16)), DDP(_mlp(16, 16, 16, seed=1))  # equal buckets
    handle = dah.register_averaging_hook(first, hook, state, period=2)
    for _ in range(4):  # rounds of changes that compress with an error fill the memory
        with torch.no_grad():
            for p in first.parameters():
                p.add_(torch.randn_like(p) / 3)
        handle.step()
    memory = _tensors(state.state_dict())
    assert memory and any(t.abs().sum() > 0 for t in memory)
    with pytest.raises(ValueError, match="already serves a live registration.*remove"):
        dah.register_averaging_hook(second, hook, state, period=2)
    handle.remove()
    again = dah.register_averaging_hook(second, hook, state, period=2)
    assert again.state is state and handle.removed and not again.removed
    assert all(torch.equal(a, b) for a, b in zip(_tensors(state.state_dict()), memory))


def test_state_wrapped_by_an_outer_state_serves_one_live_registration(world1):
    inner = dah.hooks.QuantizedDeltaState()
    outer = dah.hooks.outer_optimizer(dah.hooks.int8_compress_hook)
    handle = dah.register_averaging_hook(DDP(_mlp(3, 2)), outer,
                                         dah.hooks.OuterOptimizerState(inner))
    with pytest.raises(ValueError, match="QuantizedDeltaState already serves a live"):
        dah.register_averaging_hook(DDP(_mlp(3, 2)), dah.hooks.int8_compress_hook, inner)
    handle.remove()
    dah.register_averaging_hook(DDP(_mlp(3, 2)), dah.hooks.int8_compress_hook, inner)


def test_state_of_a_handle_gone_is_free(world1):
    import gc
    state = dah.hooks.QuantizedDeltaState()
    handle = dah.register_averaging_hook(DDP(_mlp(3, 2)), dah.hooks.int8_compress_hook, state)
    del handle
    gc.collect()
    again = dah.register_averaging_hook(DDP(_mlp(3, 2)), dah.hooks.int8_compress_hook, state)
    assert again.state is state


def test_states_without_memory_may_be_shared(world1):
    import torch.distributed as dist
    group = dist.new_group([0])
    for hook, state in [(dah.hooks.allreduce_hook, None), (dah.hooks.int8_compress_hook, None),
                        (dah.hooks.int8_compress_hook, group)]:
        handles = [dah.register_averaging_hook(DDP(_mlp(3, 2)), hook, state) for _ in range(2)]
        assert all(not h.removed for h in handles)


def test_rejects_model_without_trainable_parameters(world1):
    model = _mlp(3, 2)
    ddp = DDP(model)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)


# --- schedule ---------------------------------------------------------------------
@pytest.mark.parametrize("period, warmup", [(1, 0), (3, 0), (4, 5), (2, 1)])
def test_schedule_matches_periodic_model_averager(world1, period, warmup):
    from torch.distributed.algorithms.model_averaging import averagers
    import torch.distributed.algorithms.model_averaging.utils as avg_utils

    ddp = DDP(_mlp(3, 2))
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                         period=period, warmup_steps=warmup)
    reference = averagers.PeriodicModelAverager(period=period, warmup_steps=warmup)
    calls = []
    original = avg_utils.average_parameters_or_parameter_groups
    avg_utils.average_parameters_or_parameter_groups = lambda *a, **k: calls.append(1)
    try:
        ours, theirs = [], []
        for _ in range(20):
            in_warmup = handle.in_warmup
            assert in_warmup == (handle.step_count < warmup)
            ours.append(handle.step())
            n = len(calls)
            reference.average_parameters(ddp.parameters())
            theirs.append(len(calls) > n)
    finally:
        avg_utils.average_parameters_or_parameter_groups = original
    assert ours == theirs
    assert handle.stats.rounds == sum(ours) and handle.step_count == 20


def test_average_runs_outside_the_schedule(world1):
    ddp = DDP(_mlp(3, 2))
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=100)
    handle.average()
    assert handle.step_count == 0 and handle.stats.rounds == 1
    assert handle.stats.bytes_sent == sum(p.numel() * 4 for p in ddp.parameters())
    assert handle.stats.seconds > 0


def test_optimizer_mode_and_remove(world1):
    ddp = DDP(_mlp(3, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         optimizer=opt)
    for _ in range(3):
        opt.zero_grad(); ddp(torch.randn(4, 3)).sum().backward(); opt.step()
    assert handle.step_count == 3 and handle.stats.rounds == 2
    handle.remove()
    opt.step()
    assert handle.step_count == 3
    with pytest.raises(RuntimeError, match="after remove"):
        handle.step()
    handle.remove()  # idempotent


def test_stepping_a_handle_the_optimizer_already_steps_is_refused(world1):
    ddp = DDP(_mlp(3, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         optimizer=opt)
    opt.zero_grad(); ddp(torch.randn(4, 3)).sum().backward(); opt.step()
    with pytest.raises(RuntimeError, match="detach_optimizer"):
        handle.step()  # would count the optimizer's step twice
    assert handle.step_count == 1
    handle.detach_optimizer()
    opt.step()
    assert not handle.step() and handle.step_count == 2  # stepped by hand from here on
    assert handle.step() and handle.stats.rounds == 2  # step 2 averages (period 2)
    handle.remove()


def test_a_second_attach_is_refused_and_remove_detaches_the_one_hook(world1):
    ddp = DDP(_mlp(3, 2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         optimizer=opt)
    with pytest.raises(ValueError, match="already runs step\\(\\) after an optimizer's steps"):
        handle.attach_optimizer(opt)
    opt.zero_grad(); ddp(torch.randn(4, 3)).sum().backward(); opt.step()
    assert handle.step_count == 1  # one optimizer step, counted once
    handle.detach_optimizer()
    handle.attach_optimizer(opt)  # moved: allowed once detached
    opt.step()
    assert handle.step_count == 2
    handle.remove()
    opt.step()  # the plain optimizer steps on after remove()
    assert not handle.attached_optimizer
    with pytest.raises(RuntimeError, match=r"attach_optimizer\(\) after remove\(\)"):
        handle.attach_optimizer(opt)


def test_an_optimizer_of_other_parameters_is_refused(world1):
    ddp = DDP(_mlp(3, 2))
    other = torch.optim.SGD(_mlp(3, 2).parameters(), lr=0.1)  # another model's optimizer
    with pytest.raises(ValueError, match=r"holds none of the averaged model's trainable "
                                         r"parameters \(0.weight, 0.bias\)"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, optimizer=other)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
    with pytest.raises(ValueError, match="attach_optimizer: the optimizer"):
        handle.attach_optimizer(other)
    assert not handle.attached_optimizer
    # one optimizer over this model and another, or over a part of this one: accepted
    both = torch.optim.SGD([*other.param_groups[0]["params"], ddp.module[0].bias], lr=0.1)
    handle.attach_optimizer(both)
    both.zero_grad(); ddp(torch.randn(4, 3)).sum().backward(); both.step()
    assert handle.step_count == 1
    handle.remove()


def test_a_comm_hook_given_another_models_handle_is_refused(world1):
    ddp, other = DDP(_mlp(3, 2)), DDP(_mlp(3, 2))
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
    assert handle.averages(ddp.module[0].weight) and not handle.averages(other.module[0].weight)
    other.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    with pytest.raises(ValueError, match="averages another model"):
        other(torch.randn(4, 3)).sum().backward()  # its gradients would stay local for good
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    ddp(torch.randn(4, 3)).sum().backward()  # its own handle: accepted
    handle.remove()


def test_state_dict_round_trip_and_mismatch(world1):
    ddp = DDP(_mlp(3, 2))
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=3,
                                         warmup_steps=2)
    for _ in range(5):
        handle.step()
    saved = handle.state_dict()
    fresh = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=3,
                                        warmup_steps=2)
    fresh.load_state_dict(saved)
    assert fresh.step_count == 5 and not fresh.in_warmup
    assert [fresh.step() for _ in range(3)] == [True, False, False]
    other = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=4,
                                        warmup_steps=2)
    with pytest.raises(ValueError, match="'period' differs: 3 there, 4 here"):
        other.load_state_dict(saved)
    assert other.step_count == 0


@pytest.mark.parametrize("key, value, says", [
    ("plan", "garbage", "'plan' must be a dict of next_rounds"),
    ("config", "garbage", "'config' must be a dict"),
    ("step_count", -5, "'step_count' must be an int >= 0"),
    ("step_count", "garbage", "'step_count' must be an int >= 0"),
    ("weight_totals", "x", "'weight_totals' must be a list of numbers"),
    ("bucket_memory", None, "'bucket_memory' must be a list of 1"),
    ("stats", {}, "'stats' must be a dict of rounds"),
])
def test_a_damaged_state_dict_is_refused_changing_nothing(world1, key, value, says):
    ddp = DDP(_mlp(3, 2))
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
    for _ in range(3):
        handle.step()
    saved = handle.state_dict()
    fresh = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
    with pytest.raises(ValueError, match=f"the state dict is damaged: {says}"):
        fresh.load_state_dict({**saved, key: value})
    assert fresh.step_count == 0 and fresh.stats.rounds == 0  # nothing was loaded
    fresh.load_state_dict(saved)
    assert fresh.step_count == 3


# --- hook results are checked; failed rounds write nothing ---------------------------
def _done(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _returns_list(state, bucket):
    return [bucket.buffer()]


def _wrong_numel(state, bucket):
    return _done(bucket.buffer()[:-1])


def _int_tensor(state, bucket):
    return _done(torch.zeros(bucket.numel(), dtype=torch.int64))


def _raises(state, bucket):
    raise ZeroDivisionError("boom in hook")


def _future_raises(state, bucket):
    return _done(bucket.buffer()).then(lambda f: 1 / 0)


def _nan_result(state, bucket):
    return _done(torch.full((bucket.numel(),), float("nan")))


def _second_bucket_fails(state, bucket):
    if bucket.index() == 1:
        raise ValueError("only bucket 1 fails")
    return _done(torch.full((bucket.numel(),), 123.0))


@pytest.mark.parametrize(
    "hook, expected",
    [
        (_returns_list, "returned list; expected a torch.futures.Future"),
        (_wrong_numel, r"holds \d+ elements; expected \d+"),
        (_int_tensor, "torch.int64 tensor; expected one of torch.float32"),
        (_raises, "raised ZeroDivisionError: boom in hook"),
        (_future_raises, "its future raised"),
        (_second_bucket_fails, "bucket 1 of 2.*only bucket 1 fails"),
    ],
)
def test_bad_hook_results_raise_and_write_nothing(world1, hook, expected):
    model = _mlp(3, 4, 2)
    ddp = DDP(model)
    cap = 20 * 4 / 2**20  # first Linear (16 values) in bucket 0, the rest in bucket 1
    handle = dah.register_averaging_hook(ddp, hook, None, bucket_cap_mb=cap)
    assert len(handle.buckets) == 2
    before = _snapshot(model)
    with pytest.raises(dah.AveragingHookError, match=expected) as info:
        handle.step()
    assert hook.__name__ in str(info.value)
    _assert_unchanged(model, before)
    assert handle.step_count == 1  # the step counts: the next rounds keep their steps


def test_check_finite_rejects_nan_before_writing(world1):
    model = _mlp(3, 2)
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, _nan_result, None, check_finite=True)
    before = _snapshot(model)
    with pytest.raises(dah.AveragingHookError, match="nan or inf"):
        handle.average()
    _assert_unchanged(model, before)


@pytest.mark.parametrize("hook", ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook",
                                  "int8_compress_hook", "int4_compress_hook"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=str)
def test_check_finite_sees_a_nonfinite_parameter_through_every_builtin_hook(world1, hook, bad):
    # a compressing hook must carry nan / inf into its result (the C++ extension's int8 /
    # int4 kernels once dropped a nan from a block's scale and wrote the anchor back)
    model = _mlp(40, 3)
    ddp = DDP(model)
    handle = dah.register_averaging_hook(ddp, getattr(dah.hooks, hook), None,
                                         check_finite=True)
    with torch.no_grad():
        model[0].weight[1, 5] = bad
    before = _snapshot(model)
    with pytest.raises(dah.AveragingHookError, match="nan or inf"):
        handle.average()
    for p, b in zip(model.parameters(), before):  # unchanged, the bad value included
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0, equal_nan=True)


def test_round_allocates_nothing_the_size_of_the_model(world1):
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    ddp = DDP(model)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    ptrs = [b.buffer().data_ptr() for b in handle.buckets]
    handle.average()  # warm
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        handle.average()
    largest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert largest < model_bytes // 4, f"a round allocated {largest} B (model: {model_bytes} B)"
    assert [b.buffer().data_ptr() for b in handle.buckets] == ptrs


def test_user_hook_in_the_readme_style(world1):
    def halve_hook(state, bucket: dah.ParamBucket):
        bucket.record_sent(bucket.buffer())
        return _done(bucket.buffer().mul_(0.5))

    model = _mlp(3, 2)
    ddp = DDP(model)
    before = _snapshot(model)
    handle = dah.register_averaging_hook(ddp, halve_hook, None)
    handle.average()
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b * 0.5)
    assert handle.stats.bytes_sent == sum(b.numel() * 4 for b in before)


def test_hook_declarations_add_up_in_any_order(world1):
    # a delta hook declared by @needs_anchor under @averaging_hook(settings=...), and a
    # functools.wraps wrapper of a built-in that adds settings: both keep their anchors
    @dah.averaging_hook(settings=lambda state: {"halve": True})
    @dah.needs_anchor
    def half_step_hook(state, bucket):
        return _done(bucket.anchor() - 0.5 * bucket.delta(torch.float32))  # anchor - params

    @dah.averaging_hook(settings=lambda state: {"tag": "mine"})
    @functools.wraps(dah.hooks.int8_compress_hook)
    def my_int8(state, bucket):
        return dah.hooks.int8_compress_hook(state, bucket)

    for hook in (half_step_hook, my_int8):
        model = _mlp(3, 2)
        ddp = DDP(model)
        handle = dah.register_averaging_hook(ddp, hook, None)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        handle.average()  # one rank: the anchor plus half / all of the change
        for p, b in zip(model.parameters(), _snapshot(_mlp(3, 2))):
            want = b + (0.5 if hook is half_step_hook else 1.0)
            torch.testing.assert_close(p.detach(), want, rtol=0, atol=0.02)
        assert dah.hook_spec(hook).settings is not None


def test_a_failed_round_keeps_the_following_rounds_on_their_steps(world1):
    calls = []

    def fails_once(state, bucket):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("a passing failure")
        return _done(bucket.buffer())

    handle = dah.register_averaging_hook(DDP(_mlp(3, 2)), fails_once, None, period=2,
                                         warmup_steps=1)
    averaged = []
    for s in range(10):
        try:
            averaged.append(handle.step())
        except dah.AveragingHookError:
            averaged.append("failed")
    # the schedule's rule: rounds at s >= 1 with (s - 1) % 2 == 0, the failed one included
    assert averaged == [False, True, False, "failed", False, True, False, True, False, True]
    assert handle.step_count == 10 and handle.stats.rounds == 4


def test_a_settings_declaration_that_fails_names_the_hook_at_registration(world1):
    @dah.averaging_hook(settings=lambda state: {"block": state.block_size})
    def blocky_hook(state, bucket):
        return _done(bucket.buffer())

    with pytest.raises(TypeError, match="'.*blocky_hook'.*settings.*AttributeError.*NoneType"):
        dah.register_averaging_hook(DDP(_mlp(3, 2)), blocky_hook, None)


def test_a_failed_registration_leaves_nothing_live(world1):
    ddp = DDP(_mlp(3, 2))
    first = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    first.remove()

    def no_memory(state, bucket):
        raise MemoryError("no room for the hook's memory")

    @dah.averaging_hook(prepare_bucket=no_memory)
    def needs_memory_hook(state, bucket):
        return _done(bucket.buffer())

    with pytest.raises(MemoryError) as failed:  # its traceback holds the failed handle
        dah.register_averaging_hook(ddp, needs_memory_hook, None)
    assert first.successor is None and failed.value  # the comm hook ignores the failed one
    second = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    assert first.successor is second


def test_attaching_something_that_is_not_an_optimizer_is_refused(world1):
    ddp = DDP(_mlp(3, 2))
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None)
    for wrong in (ddp, None):
        with pytest.raises(TypeError, match="expected an optimizer.*got "
                           f"{type(wrong).__name__}"):
            handle.attach_optimizer(wrong)
    handle.remove()
