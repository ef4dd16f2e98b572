"""fragments=K: the model's parameters, cut into K parts, take turns being averaged."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import params_of
from ddp_avg_hooks.planner import split_fragments


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8),
                               torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batch_step(model, opt, rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_split_is_near_equal_in_order_and_never_splits_a_parameter():
    sizes = [48, 8, 64, 8, 64, 8, 24, 3]
    params = [torch.zeros(n) for n in sizes]
    for k in range(1, len(sizes) + 1):
        parts = split_fragments(params, k)
        assert len(parts) == k and all(parts)
        assert [p for part in parts for p in part] == params  # order kept, nothing split
    parts = split_fragments(params, 2)
    totals = [sum(p.numel() for p in part) for part in parts]
    assert totals == [120, 107]  # the cut closest to an equal share
    with pytest.raises(ValueError, match="only 8 parameters"):
        split_fragments(params, 9)


def _expected_fragment(step, warmup, period, k):
    for f in range(k):
        if step >= warmup and (step - warmup - f * period // k) % period == 0:
            return f
    return None


def test_which_fragment_each_step_averages(world1):
    calls = []

    def spy(state, bucket):
        calls.append(bucket.index())
        return dah.hooks.allreduce_hook(state, bucket)

    for period, k, warmup in [(8, 4, 3), (5, 3, 0), (7, 2, 1), (4, 1, 2)]:
        model = _model()
        handle = dah.register_averaging_hook(DDP(model), spy, None, period=period,
                                             warmup_steps=warmup, fragments=k, bucket_cap_mb=1e-4)
        owner = {}  # bucket index -> fragment, from the parameters the bucket holds
        parts = split_fragments(list(model.parameters()), k)
        for b in handle.buckets:
            f = next(i for i, part in enumerate(parts) if any(p is b.parameters()[0] for p in part))
            owner[b.index()] = f
        for step in range(40):
            calls.clear()
            averaged = handle.step()
            expected = _expected_fragment(step, warmup, period, k)
            assert averaged == (expected is not None)
            assert {owner[i] for i in calls} == ({expected} if expected is not None else set())
            if expected is not None:  # every bucket of that fragment
                assert sorted(calls) == sorted(i for i, f in owner.items() if f == expected)
        assert handle.fragments == k
        handle.remove()


def test_bad_fragments_are_value_errors(world1):
    ddp = DDP(_model())
    with pytest.raises(ValueError, match=r"period \(3\) must be >= fragments \(4\)"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=3, fragments=4)
    with pytest.raises(ValueError, match="fragments must be >= 1"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=3, fragments=0)
    with pytest.raises(ValueError, match="needs an int period"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, fragments=2,
                                    period=dah.schedules.StepwisePeriod(4, {10: 8}))
    with pytest.raises(ValueError, match="only 6 parameters"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=8, fragments=7)
    with pytest.raises(ValueError, match="fragment_layout must be one of"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=8, fragments=2,
                                    fragment_layout="strided")
    with pytest.raises(ValueError, match=r"pass fragments=K \(K > 1\) too"):
        dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=8,
                                    fragment_layout="interleaved")


def _rank_fragment_rounds(rank, world_size, hook_name, overlap, layout):
    """Each round: the due fragment equals the mean of the ranks' values (gathered
    before the round), every other parameter is untouched."""
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = getattr(dah.hooks, hook_name)
    handle = dah.register_averaging_hook(ddp, hook, None, period=4, fragments=2,
                                         optimizer=None, overlap=overlap,
                                         fragment_layout=layout)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    parts = split_fragments(list(model.parameters()), 2, layout=layout)
    index = {id(p): f for f, part in enumerate(parts) for p in part}
    round_bytes = []
    for step in range(14):
        _batch_step(ddp, opt, rank, step)
        before = params_of(model)
        gathered = [torch.cat([p.reshape(-1) for p in before]).clone() for _ in range(world_size)]
        dist.all_gather(gathered, gathered[rank].clone())
        mean = torch.stack(gathered).double().mean(0)
        fragment = _expected_fragment(step, 0, 4, 2)
        handle.step()
        handle.synchronize()  # overlap: apply now, with no progress in between
        if fragment is None:
            continue
        round_bytes.append(handle.stats.last_round_bytes)
        offset = 0
        for p, b in zip(model.parameters(), before):
            n = p.numel()
            if index[id(p)] == fragment:
                # fp16 deltas: within the rounding of a half-precision delta
                tol = 0 if hook_name == "allreduce_hook" else 2e-3
                ref = mean[offset:offset + n].view(p.shape).float()
                assert torch.allclose(p.detach(), ref, atol=tol, rtol=0), (step, fragment)
                if not overlap:  # (an overlapped round: the anchors agree, checked below)
                    same = [p.detach().reshape(-1).clone() for _ in range(world_size)]
                    dist.all_gather(same, p.detach().reshape(-1).clone())
                    assert all(torch.equal(same[0], s) for s in same)
            else:
                assert torch.equal(p.detach(), b)
            offset += n
        if overlap:
            for b in handle.buckets:
                same = [b.anchor().clone() for _ in range(world_size)]
                dist.all_gather(same, b.anchor().clone())
                assert all(torch.equal(same[0], s) for s in same)
    full = dah.register_averaging_hook(DDP(_model()), hook, None, period=4)
    full.step()
    handle.remove()
    return round_bytes, full.stats.last_round_bytes


@pytest.mark.parametrize("hook_name,overlap,layout", [
    ("allreduce_hook", False, "contiguous"), ("fp16_compress_hook", True, "contiguous"),
    ("allreduce_hook", False, "interleaved"), ("fp16_compress_hook", True, "interleaved")])
def test_fragment_rounds_average_one_fragment_each(hook_name, overlap, layout):
    results = run_ranks(_rank_fragment_rounds, 2, hook_name=hook_name, overlap=overlap,
                        layout=layout)
    round_bytes, full_bytes = results[0]
    # each round sends one fragment's bytes; a period sends every parameter once
    parts = split_fragments(list(_model().parameters()), 2, layout=layout)
    sizes = [sum(p.numel() for p in part) for part in parts]
    per_element = full_bytes // sum(sizes)
    assert round_bytes == [sizes[i % 2] * per_element for i in range(7)]


def _rank_outer_resume(rank, world_size, tmp, stop, layout):
    """DiLoCo with fragments (each fragment its own outer step), checkpointed at step
    ``stop`` and resumed in a fresh registration: identical to never stopping."""
    def run(until, resume_from=None):
        model = _model()
        ddp = DDP(model)
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        state = dah.hooks.OuterOptimizerState()
        hook = dah.hooks.outer_optimizer(dah.hooks.allreduce_hook)
        handle = dah.register_averaging_hook(ddp, hook, state, period=4, fragments=2,
                                             optimizer=inner, fragment_layout=layout)
        ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
        start = 0
        if resume_from is not None:
            saved = torch.load(resume_from, weights_only=False)
            model.load_state_dict(saved["model"])
            inner.load_state_dict(saved["inner"])
            handle.load_state_dict(saved["handle"])
            start = handle.step_count
        for step in range(start, until):
            _batch_step(ddp, inner, rank, step)
        return model, inner, handle

    model, _, _ = run(12)
    uninterrupted = params_of(model)
    model, inner, handle = run(stop)
    path = f"{tmp}/rank{rank}.pt"
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(),
                "handle": handle.state_dict()}, path)
    model, _, handle = run(12, resume_from=path)
    return [torch.equal(a, b) for a, b in zip(params_of(model), uninterrupted)], handle.stats.rounds


@pytest.mark.parametrize("layout", ["contiguous", "interleaved"])
def test_outer_optimizer_fragments_resume_exactly(tmp_path, layout):
    for ok, rounds in run_ranks(_rank_outer_resume, 2, tmp=str(tmp_path), stop=6,
                                layout=layout):
        assert all(ok) and rounds == 6


def test_fragments_one_is_the_plain_schedule(world1):
    a, b = _model(), _model()
    ha = dah.register_averaging_hook(DDP(a), dah.hooks.allreduce_hook, None, period=3,
                                     warmup_steps=2)
    hb = dah.register_averaging_hook(DDP(b), dah.hooks.allreduce_hook, None, period=3,
                                     warmup_steps=2, fragments=1)
    assert [ha.step() for _ in range(20)] == [hb.step() for _ in range(20)]
    assert ha.state_dict()["next_round"] == hb.state_dict()["next_round"]


def _rank_streaming_int8(rank, world_size):
    """int8 deltas, fragments=2, a round every step, overlapped, each round's result held
    back 0.3 s: the next fragment's round launches while one is in flight. When a
    fragment's round is applied its anchor is the ranks' mean at launch, within the
    quantization's error (error feedback keeps it from adding up)."""
    model = _model()
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    launches = {}  # bucket index -> [(anchor, every rank's parameters) at each launch]
    inner = dah.hooks.int8_compress_hook
    spec = dah.hook_spec(inner)

    @dah.averaging_hook(needs_anchor=True, validate_state=spec.validate_state,
                        prepare_bucket=spec.prepare_bucket)
    def spy(state, bucket):
        mine = bucket.buffer().clone()
        ranks = [mine.clone() for _ in range(world_size)]
        dist.all_gather(ranks, mine)  # from the training thread, in bucket order: safe
        launches.setdefault(bucket.index(), []).append(
            (bucket.anchor().double().clone(), torch.stack(ranks).double()))
        late = torch.futures.Future()
        inner(state, bucket).add_done_callback(
            lambda f: threading.Timer(0.3, late.set_result, args=(f.value(),)).start())
        return late

    handle = dah.register_averaging_hook(ddp, spy, None, period=2, fragments=2, overlap=True)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    tracked, applied, most_in_flight, worst = [], {}, 0, 0.0

    def check(pending):
        nonlocal worst
        for b in pending.buckets:
            k = applied[b.index()] = applied.get(b.index(), -1) + 1
            anchor_then, ranks = launches[b.index()][k]
            change = float((anchor_then - ranks).abs().max())  # the largest delta
            error = float((b.anchor().double() - ranks.mean(0)).abs().max())
            worst = max(worst, error / max(change, 1e-12))

    for step in range(12):
        _batch_step(ddp, opt, rank, step)
        handle.step()
        most_in_flight = max(most_in_flight, len(handle.rounds_in_flight))
        tracked += [p for p in handle.rounds_in_flight if p not in tracked]
        for pending in [p for p in tracked if p not in handle.rounds_in_flight]:
            check(pending)
            tracked.remove(pending)
    handle.synchronize()
    for pending in tracked:
        check(pending)
    anchors = torch.cat([b.anchor() for b in handle.buckets])
    same = [anchors.clone() for _ in range(world_size)]
    dist.all_gather(same, anchors.clone())
    assert all(torch.equal(same[0], s) for s in same)
    rounds = handle.stats.rounds
    handle.remove()
    return most_in_flight, rounds, worst


def test_streaming_int8_rounds_overlap_each_other_and_follow_the_mean():
    results = run_ranks(_rank_streaming_int8, 2)
    for most_in_flight, rounds, worst in results:
        assert most_in_flight == 2  # the two fragments' rounds were in flight together
        assert rounds == 12
        # the anchor is the launch-time mean up to the int8 rounding of the change: at
        # most 1/254 of the largest change per rounding, two roundings per round, plus
        # the residual carried from the last round (about as large again)
        assert worst < 6 / 254, worst
