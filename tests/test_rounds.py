"""The round engine with fake hooks, in one process: the order of a round, the hook
contract's checks, what a failed round leaves, stats, policies and observers."""

from __future__ import annotations

import pytest
import torch

import ddp_avg_hooks as dah
from ddp_avg_hooks.bucket import ParamBucket
from ddp_avg_hooks.collectives import completed
from ddp_avg_hooks.observers import RoundObserver
from ddp_avg_hooks.policies import RoundPolicy
from ddp_avg_hooks.rounds import RoundEngine, run_round


def _buckets(n: int = 2, *, keep_anchor: bool = False) -> list[ParamBucket]:
    return [ParamBucket(i, [torch.nn.Parameter(torch.full((3,), float(i)))], is_last=i == n - 1,
                        keep_anchor=keep_anchor) for i in range(n)]


def _values(buckets) -> list[list[float]]:
    return [b.parameters()[0].detach().tolist() for b in buckets]


def plus_ten(state, bucket):
    """A fake average: the bucket's values plus 10, counting the bytes of its buffer."""
    bucket.record_sent(bucket.buffer())
    return completed(bucket.buffer() + 10)


def test_a_round_writes_the_results_and_counts_stats():
    buckets = _buckets()
    engine = RoundEngine(plus_ten, None, buckets)
    rnd = engine.finish(engine.launch(where="round 1, step 0"))
    assert _values(buckets) == [[10.0] * 3, [11.0] * 3]
    assert rnd.bytes_sent == 24 and engine.stats.rounds == 1 and engine.stats.bytes_sent == 24
    assert engine.stats.last_round_bytes == 24 and engine.stats.seconds >= engine.stats.wait_seconds


def test_a_delta_result_is_applied_as_anchor_minus_change():
    buckets = _buckets(keep_anchor=True)
    with torch.no_grad():
        buckets[1].parameters()[0].add_(5)  # 6: anchor 1

    def halve_change(state, bucket):
        bucket.mark_result_as_delta()
        return completed(bucket.delta(torch.float16, scale=0.5))

    run_round(halve_change, None, buckets)
    assert _values(buckets) == [[0.0] * 3, [3.5] * 3]  # 1 - (1 - 6) / 2
    assert torch.equal(buckets[1].stored_anchor(), torch.full((3,), 3.5))


def test_strided_and_shaped_results_are_written_as_their_values():
    buckets = _buckets(keep_anchor=True)
    with torch.no_grad():
        buckets[1].parameters()[0].add_(5)  # 6: anchor 1

    def strided(state, bucket):  # every other element of a buffer twice as long
        if bucket.index() == 0:
            wide = torch.stack([bucket.buffer() + 10, torch.full((3,), -1.0)], 1).reshape(-1)
            return completed(wide[::2])
        bucket.mark_result_as_delta()  # the change halved, as a strided (1, 3) row
        change = bucket.delta(torch.float32, scale=0.5)
        return completed(torch.stack([change, torch.zeros(3)], 1).t()[:1])

    assert not strided(None, buckets[0]).wait().is_contiguous()
    assert not strided(None, buckets[1]).wait().is_contiguous()
    run_round(strided, None, buckets)
    assert _values(buckets) == [[10.0] * 3, [3.5] * 3]


@pytest.mark.parametrize("result, message", [
    (lambda b: completed(torch.zeros(2)), "holds 2 elements; expected 3"),
    (lambda b: completed(torch.zeros(3, dtype=torch.int64)), "holds a torch.int64 tensor"),
    (lambda b: completed("three"), "holds str; expected a floating-point tensor of 3"),
    (lambda b: [1.0, 2.0, 3.0], "returned list; expected a torch.futures.Future"),
    (lambda b: completed(torch.zeros(3, device="meta")), "on the meta device"),
    (lambda b: completed(torch.zeros(3, dtype=torch.float8_e4m3fn)),
     "holds a torch.float8_e4m3fn tensor; expected one of torch.float32"),
    pytest.param(lambda b: completed(torch.zeros(3, device="cuda")),
                 "on cuda:0, the parameters are on cpu", id="another-device",
                 marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
    (lambda b: (_ for _ in ()).throw(ValueError("no")), "raised ValueError: no"),
])
def test_a_broken_result_fails_the_round_and_writes_nothing(result, message):
    buckets = _buckets()

    def hook(state, bucket):
        bucket.record_sent(torch.zeros(4))
        return plus_ten(state, bucket) if bucket.index() == 0 else result(bucket)

    engine = RoundEngine(hook, None, buckets)
    with pytest.raises(dah.AveragingHookError, match=message) as err:
        engine.finish(engine.launch(where="round 3, step 7"))
    assert "hook" in str(err.value) and "bucket 1 of 2 (round 3, step 7)" in str(err.value)
    assert _values(buckets) == [[0.0] * 3, [1.0] * 3]  # nothing written, not even bucket 0
    assert engine.stats.rounds == 0


def test_check_finite_rejects_nan_before_writing():
    buckets = _buckets()
    engine = RoundEngine(lambda s, b: completed(b.buffer() * float("nan")), None, buckets,
                         check_finite=True)
    rnd = engine.launch()
    with pytest.raises(dah.AveragingHookError, match="nan or inf .*nothing written"):
        engine.finish(rnd)
    assert _values(buckets) == [[0.0] * 3, [1.0] * 3]


def test_bytes_are_counted_even_when_a_round_fails():
    buckets = _buckets()
    engine = RoundEngine(lambda s, b: (b.record_sent(torch.zeros(5)), completed(torch.zeros(1)))[1],
                         None, buckets)
    with pytest.raises(dah.AveragingHookError):
        engine.finish(engine.launch())
    assert engine.stats.bytes_sent == 40 and engine.stats.rounds == 0


def test_deferred_calls_run_after_every_hook_in_bucket_order():
    events = []

    def hook(state, bucket):
        events.append(("hook", bucket.index()))
        fut = torch.futures.Future()

        def second_phase():
            events.append(("deferred", bucket.index()))
            fut.set_result(bucket.buffer())
        bucket.defer(second_phase)
        return fut

    run_round(hook, None, _buckets(3))
    assert events == [("hook", 0), ("hook", 1), ("hook", 2),
                      ("deferred", 0), ("deferred", 1), ("deferred", 2)]


def test_a_failing_deferred_call_lets_the_others_run_then_fails_the_round():
    ran = []

    def hook(state, bucket):
        fut = torch.futures.Future()

        def phase():
            ran.append(bucket.index())
            if bucket.index() == 0:
                raise OSError("link down")
            fut.set_result(bucket.buffer())
        bucket.defer(phase)
        return fut

    engine = RoundEngine(hook, None, _buckets(2))
    with pytest.raises(dah.AveragingHookError, match="bucket 0 .*deferred call raised OSError"):
        engine.launch()
    assert ran == [0, 1]


def test_a_fragment_round_touches_only_its_fragment():
    buckets = _buckets(3)
    engine = RoundEngine(plus_ten, None, buckets, fragments=[buckets[:1], buckets[1:]])
    rnd = engine.finish(engine.launch(fragment=1))
    assert rnd.fragment == 1 and rnd.buckets == buckets[1:]
    assert _values(buckets) == [[0.0] * 3, [11.0] * 3, [12.0] * 3]


class _Extras(RoundPolicy):
    def __init__(self, bucket):
        self.bucket, self.after = bucket, 0

    def buckets(self):
        return [self.bucket]

    def after_write_back(self):
        self.after += 1


def test_policies_average_their_buckets_and_act_after_the_write_back(world1):
    extra = ParamBucket(0, [torch.full((2,), 4.0)], is_last=True)
    policy = _Extras(extra)
    buckets = _buckets(2)
    engine = RoundEngine(plus_ten, None, buckets, fragments=[buckets[:1], buckets[1:]],
                         policies=[policy])
    engine.finish(engine.launch(fragment=1))  # the extras go with fragment 0 only
    assert policy.after == 1 and engine.stats.bytes_sent == 12
    rnd = engine.finish(engine.launch(fragment=0))
    assert rnd.extras == [extra] and policy.after == 2
    assert engine.stats.bytes_sent == 12 + 12 + 8  # a world of one: the exact average is itself
    assert extra.parameters()[0].tolist() == [4.0, 4.0]


class _Recorder(RoundObserver):
    def __init__(self, collective):
        self.collective, self.seen = collective, []

    def measure(self, buckets, rnd):
        return [r.clone() for r in rnd.results]

    def report(self, handle, round_number, measured):
        self.seen.append((handle, round_number, [m.tolist() for m in measured]))


def test_observers_measure_before_the_write_back_and_report_after():
    local, collective = _Recorder(False), _Recorder(True)
    buckets = _buckets(1)
    engine = RoundEngine(plus_ten, None, buckets, observers=[local, collective])
    assert engine.collective_reports
    engine.finish(engine.launch(), handle="h")
    assert local.seen == collective.seen == [("h", 1, [[10.0] * 3])]
    # an overlapped round's collective report waits for a step all ranks share
    engine.finish(engine.launch(overlapped=True), handle="h")
    assert len(local.seen) == 2 and len(collective.seen) == 1
    engine.report_deferred("h")
    assert collective.seen[-1][1] == 2


def test_run_round_is_a_launch_and_a_finish():
    between = []
    buckets = _buckets(2)
    rnd = run_round(plus_ten, None, buckets, between=lambda: between.append(len(_values(buckets))))
    assert between == [2] and rnd.results is not None and rnd.bytes_sent == 24
    assert rnd.done()
