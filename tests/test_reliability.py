"""Stop anywhere and resume exactly; fail loudly, never hang, never diverge silently."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import (batch as _batch, make_model as _make_model, params_of,
                      train_step as _train_step)

LR = 0.05


DIMS = (6, 12, 4)


def make_model(seed: int = 0) -> torch.nn.Module:
    return _make_model(seed, dims=DIMS)


def batch(rank: int, step: int):
    return _batch(rank, step, n=8, dims=DIMS)


def train_step(ddp, opt, rank, step):
    _train_step(ddp, opt, rank, step, n=8, dims=DIMS)


# --- checkpoint / resume --------------------------------------------------------------
def _hook_and_state(name: str):
    h = dah.hooks
    return {
        "allreduce": lambda: (h.allreduce_hook, None),
        "fp16": lambda: (h.fp16_compress_hook, None),
        "fp16_state": lambda: (h.fp16_compress_hook, h.HalfDeltaState()),
        "bf16": lambda: (h.bf16_compress_hook, h.HalfDeltaState()),
        "powersgd": lambda: (h.powersgd_hook,
                             h.PowerSGDState(matrix_approximation_rank=1, start_powersgd_round=1)),
    }[name]()


PERIOD, WARMUP, STEPS = 3, 2, 12
CUTS = (1, 4, 6)  # steps done when cut: inside warm-up, mid-period, right after a round


def _setup(rank, name, seed=0):
    model = make_model(seed)
    ddp = DDP(model)
    hook, state = _hook_and_state(name)
    handle = dah.register_averaging_hook(ddp, hook, state, period=PERIOD, warmup_steps=WARMUP)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
    return model, ddp, handle, opt


def _rank_uninterrupted(rank, world_size, names, ckpt_dir):
    out = {}
    for name in names:
        model, ddp, handle, opt = _setup(rank, name)
        for step in range(STEPS):
            train_step(ddp, opt, rank, step)
            handle.step()
            if step + 1 in CUTS:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "averaging": handle.state_dict()},
                           os.path.join(ckpt_dir, f"{name}_{step + 1}_rank{rank}.pt"))
        out[name] = params_of(model)
        handle.remove()
    return out


def _rank_resumed(rank, world_size, names, ckpt_dir):
    out = {}
    for name in names:
        for cut in CUTS:
            # a different initialisation: everything must come from the checkpoint
            model, ddp, handle, opt = _setup(rank, name, seed=123)
            ckpt = torch.load(os.path.join(ckpt_dir, f"{name}_{cut}_rank{rank}.pt"),
                              weights_only=False)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["opt"])
            handle.load_state_dict(ckpt["averaging"])
            for step in range(cut, STEPS):
                train_step(ddp, opt, rank, step)
                handle.step()
            out[(name, cut)] = params_of(model)
            handle.remove()
    return out


def test_resume_in_fresh_processes_is_bit_identical_for_every_builtin_hook(tmp_path):
    names = ["allreduce", "fp16", "fp16_state", "bf16", "powersgd"]
    reference = run_ranks(_rank_uninterrupted, 2, names=names, ckpt_dir=str(tmp_path))
    resumed = run_ranks(_rank_resumed, 2, names=names, ckpt_dir=str(tmp_path))
    for rank in range(2):
        for name in names:
            for cut in CUTS:
                got, want = resumed[rank][(name, cut)], reference[rank][name]
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (rank, name, cut)


def test_state_dict_is_plain_tensors_and_values_and_names_mismatches():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DDP(make_model())
        handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook,
                                             dah.hooks.HalfDeltaState(), period=2)
        handle.step()
        sd = handle.state_dict()

        def plain(x):
            if isinstance(x, dict):
                return all(isinstance(k, (str, int)) and plain(v) for k, v in x.items())
            if isinstance(x, (list, tuple)):
                return all(plain(v) for v in x)
            return x is None or isinstance(x, (torch.Tensor, int, float, str, bool))

        assert plain(sd)
        assert torch.load(_roundtrip(sd), weights_only=True)["step_count"] == 1
        bigger = DDP(torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.Tanh(),
                                         torch.nn.Linear(13, 4)))
        other = dah.register_averaging_hook(bigger, dah.hooks.fp16_compress_hook,
                                            dah.hooks.HalfDeltaState(), period=2)
        with pytest.raises(ValueError, match="bucket layout differs at bucket 0"):
            other.load_state_dict(sd)
        assert other.step_count == 0
        with pytest.raises(TypeError, match="expected the dict returned by"):
            other.load_state_dict({"steps": 3})
    finally:
        dist.destroy_process_group()


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


# --- faults never hang --------------------------------------------------------------
def _rank_peer_dies(rank, world_size, mode, raised):
    model, ddp, handle, opt = _setup(rank, "allreduce")
    for step in range(6):
        train_step(ddp, opt, rank, step)
        if rank == 1 and step == 3:
            if mode == "dies":
                os._exit(0)
            # stops answering until the survivor has raised (30 s at most), then goes
            # away without a result
            end = time.monotonic() + 30
            while not os.path.exists(raised) and time.monotonic() < end:
                time.sleep(0.05)
            os._exit(0)
        start = time.monotonic()
        try:
            handle.step()
        except dah.AveragingHookError as exc:
            seconds = time.monotonic() - start
            open(raised, "w").close()
            return {"error": str(exc), "seconds": seconds, "step": step}
    return {"error": None}


@pytest.mark.parametrize("mode", ["dies", "stalls"])
def test_a_dead_or_silent_peer_gives_an_error_within_the_timeout(mode, tmp_path):
    pg_timeout = 3.0
    results = run_ranks(_rank_peer_dies, 2, timeout_s=90, pg_timeout_s=pg_timeout,
                        missing_ok=True, hard_exit=True, mode=mode,
                        raised=str(tmp_path / "survivor_raised"))
    survivor = results[0]
    assert survivor["error"] is not None, "the survivor should have raised"
    assert "bucket 0 of 1" in survivor["error"] and "round 2" in survivor["error"]
    assert "Likely cause: a peer rank died" in survivor["error"]
    assert survivor["step"] == 5
    assert survivor["seconds"] < pg_timeout + 5


def _failing_on_rank_one(state, bucket):
    if dist.get_rank() == 1:
        raise RuntimeError("hook bug on rank 1")
    return dah.hooks.allreduce_hook(state, bucket)


def _rank_hook_raises(rank, world_size):
    ddp = DDP(make_model())
    handle = dah.register_averaging_hook(ddp, _failing_on_rank_one, None)
    before = params_of(ddp.module)
    start = time.monotonic()
    try:
        handle.step()
    except dah.AveragingHookError as exc:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, ddp.module.parameters()))
        return {"error": str(exc), "seconds": time.monotonic() - start, "unchanged": unchanged}
    return {"error": None}


def test_a_hook_exception_on_one_rank_does_not_hang_the_others():
    results = run_ranks(_rank_hook_raises, 2, timeout_s=60, pg_timeout_s=3, hard_exit=True)
    assert "hook bug on rank 1" in results[1]["error"]
    assert "its future raised" in results[0]["error"] and results[0]["seconds"] < 8
    assert results[0]["unchanged"] and results[1]["unchanged"]


# --- guards: check_finite, verify, GradScaler -------------------------------------------
def _local_only_hook(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())  # forgets to communicate: replicas silently diverge
    return fut


def _rank_verify(rank, world_size, case):
    ddp = DDP(make_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    hook = _local_only_hook if case == "diverged" else dah.hooks.allreduce_hook
    handle = dah.register_averaging_hook(ddp, hook, None, period=1, verify=True)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    if case == "counter" and rank == 1:
        saved = handle.state_dict()
        plan = {**saved["plan"], "next_rounds": [1]}
        handle.load_state_dict({**saved, "step_count": 1, "next_round": 1, "plan": plan})
    try:
        for step in range(3):
            train_step(ddp, opt, rank, step)
            handle.step()
    except dah.AveragingHookError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("case, expected", [
    ("diverged", "bucket 0 differs between group ranks 0 and 1"),
    ("counter", "step counters differ"),
    ("agreed", "no error"),
])
def test_verify_catches_silent_divergence_on_every_rank(case, expected):
    for msg in run_ranks(_rank_verify, 2, timeout_s=60, case=case):
        assert expected in msg


def _rank_grad_scaler(rank, world_size, steps, bad_step):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2,
                                         warmup_steps=2, verify=True)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    history, scales = [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        if rank == 1 and step == bad_step:
            loss = loss * float("inf")  # an overflow on this rank only
        scaler.scale(loss).backward()
        scaler.step(opt)  # skipped on rank 1 at bad_step
        scaler.update()
        handle.step()  # the pattern: every iteration, whether or not the step was skipped
        history.append(params_of(model))
        scales.append(scaler.get_scale())
    return {"history": history, "steps": handle.step_count, "scales": scales}


def test_grad_scaler_skip_on_one_rank_keeps_counters_agreed():
    steps, bad_step = 8, 3  # after warm-up: gradients are local, so only rank 1 skips
    r0, r1 = run_ranks(_rank_grad_scaler, 2, steps=steps, bad_step=bad_step)
    assert r0["steps"] == r1["steps"] == steps
    assert r1["scales"][bad_step] < r1["scales"][bad_step - 1]  # rank 1 really skipped
    assert r0["scales"][bad_step] == r0["scales"][bad_step - 1]
    for step in range(steps):
        same = all(torch.equal(a, b) for a, b in zip(r0["history"][step], r1["history"][step]))
        averaged = step < 2 or step % 2 == 0  # warm-up steps sync gradients; rounds at 2, 4, 6
        assert same == averaged, step


# --- property-based: random models, caps and periods ------------------------------------
def _rank_properties(rank, world_size, examples):
    from hypothesis import HealthCheck, given, settings, strategies as st

    dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])
    shape = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
    specs = st.lists(st.tuples(shape, dtypes), min_size=1, max_size=12)
    ran = []

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(specs=specs, cap_bytes=st.integers(1, 256), period=st.integers(1, 3),
           warmup=st.integers(0, 2))
    def check(specs, cap_bytes, period, warmup):
        module = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(s, dtype=d)) for s, d in specs])
        ddp = DDP(module)
        handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
                                             period=period, warmup_steps=warmup,
                                             bucket_cap_mb=cap_bytes / 2**20)
        ptrs = [p.data_ptr() for p in module]
        for step in range(warmup + 2 * period + 1):
            with torch.no_grad():  # rank-dependent values whose mean is exact in every dtype
                for i, p in enumerate(module):
                    p.copy_(torch.full(p.shape, float((i + step) % 5 + rank) * world_size))
            averaged = handle.step()
            assert averaged == (step >= warmup and (step - warmup) % period == 0)
            for i, p in enumerate(module):
                mean = (i + step) % 5 + (world_size - 1) / 2 if averaged else (i + step) % 5 + rank
                assert torch.equal(p.detach(),
                                   torch.full(p.shape, mean * world_size, dtype=p.dtype))
        assert ptrs == [p.data_ptr() for p in module]
        assert all(b.numel() * b.buffer().element_size() <= cap_bytes or len(b.parameters()) == 1
                   for b in handle.buckets)
        handle.remove()
        ran.append(1)

    check()
    return len(ran)


def test_property_random_models_caps_and_periods():
    counts = run_ranks(_rank_properties, 2, timeout_s=240, examples=30)
    assert counts[0] == counts[1] >= 20


# --- a long run does not grow resident memory ----------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rank_long_run(rank, world_size, steps):
    model = torch.nn.Linear(4, 2)
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook, None, period=2,
                                         optimizer=opt)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    x = torch.randn(4, 4)
    rss = {}
    for step in range(steps):
        opt.zero_grad()
        ddp(x).pow(2).mean().backward()
        opt.step()
        if step + 1 in (steps // 5, steps):
            rss[step + 1] = _rss_bytes()
    return {"rss": rss, "rounds": handle.stats.rounds}


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_ten_thousand_steps_do_not_grow_resident_memory():
    steps = 10_000
    for res in run_ranks(_rank_long_run, 2, timeout_s=240, steps=steps):
        assert res["rounds"] == steps // 2
        growth = res["rss"][steps] - res["rss"][steps // 5]
        assert growth < 4 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB"


@pytest.mark.parametrize("name", ["fp16", "powersgd"])
def test_torch_distributed_checkpoint_takes_the_state_dict(tmp_path, name):
    """DCP loads in place into a fresh handle's state_dict(): the per-bucket memory must
    exist from registration on. Key it by rank: the state differs between ranks."""
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = make_model()
        ddp = DDP(model)
        handle = dah.register_averaging_hook(ddp, *_hook_and_state(name), period=1)
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        for step in range(3):
            train_step(ddp, opt, 0, step)
            handle.step()
        saved = handle.state_dict()
        dcp.save({"rank0": saved}, checkpoint_id=str(tmp_path))
        fresh = dah.register_averaging_hook(ddp, *_hook_and_state(name), period=1)
        target = {"rank0": fresh.state_dict()}
        dcp.load(target, checkpoint_id=str(tmp_path))
        fresh.load_state_dict(target["rank0"])
        restored = fresh.state_dict()

        def tensors(x):
            if isinstance(x, dict):
                return [t for k in sorted(x, key=str) for t in tensors(x[k])]
            if isinstance(x, (list, tuple)):
                return [t for v in x for t in tensors(v)]
            return [x] if isinstance(x, torch.Tensor) else []

        assert restored["step_count"] == 3
        assert len(tensors(saved)) == len(tensors(restored)) >= 2  # anchors + hook memory
        assert all(torch.equal(a, b) for a, b in zip(tensors(saved), tensors(restored)))
    finally:
        dist.destroy_process_group()
