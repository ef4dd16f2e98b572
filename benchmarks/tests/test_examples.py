"""The training example as users run it: torchrun, 2 CPU ranks, a tiny model."""
from __future__ import annotations

import os

import pytest

from harness import launch, train

TINY = ["--preset", "tiny", "--steps", "40", "--eval-every", "16", "--lr", "3e-3",
        "--period", "4", "--progress", "off", "--corpus-bytes", "400000", "--timeout", "60"]


@pytest.fixture(autouse=True)
def _no_extension_build(monkeypatch):
    # the example tests exercise the script, not the C++ build (make ext prebuilds it)
    monkeypatch.setenv("DDP_AVG_HOOKS_DISABLE_EXT", "1")


def _run(hook: str, tmp_path, extra=()) -> dict:
    return launch.run_training([*TINY, "--hook", hook, *extra], str(tmp_path / hook),
                               timeout_s=120)


def _first_last(steps, k=5):
    losses = [s["loss"] for s in steps]
    return sum(losses[:k]) / k, sum(losses[-k:]) / k


@pytest.mark.torchrun
def test_ddp_trains_and_counts_gradient_bytes(tmp_path):
    # --stop-at-loss: any loss stops at the first validation past --min-steps
    r = _run("ddp", tmp_path, ["--stop-at-loss", "100", "--min-steps", "20"])
    assert r["config"]["steps_done"] == 32 and len(r["steps"]) == 32
    assert r["evals"][-1]["step"] == 32 and r["evals"][-1]["final"]
    first, last = _first_last(r["steps"])
    assert last < first - 0.5, (first, last)
    assert r["evals"][-1]["val_loss"] < r["evals"][0]["val_loss"]
    assert r["config"]["world_size"] == 2
    # DDP all-reduces every gradient once per step: the fp32 model, tied weights counted once
    assert {s["bytes"] for s in r["steps"]} == {4 * r["config"]["n_params"]}
    assert r["summary"]["per_rank_bytes"][0] == r["summary"]["per_rank_bytes"][1]
    assert os.path.exists(tmp_path / "ddp" / "metrics.json")


def test_time_budget_and_timed_validation(tmp_path):
    budget, every = 1.0, 0.25
    r = _run("ddp", tmp_path, ["--steps", "100000", "--time-budget", str(budget),
                               "--eval-every", "0", "--eval-every-s", str(every)])
    s, done = r["summary"], r["config"]["steps_done"]
    assert s["stopped_by"] == "time_budget" and done == len(r["steps"]) < 100000
    clock = [0.0]
    for rec in r["steps"]:
        clock.append(clock[-1] + rec["step_s"])
    # the first step at which the training clock reached the budget is the last one; the
    # clock is read just before the step's handshake, which the step's time includes: slack
    slack = 0.05
    assert clock[-2] < budget + slack and budget <= clock[-1] + 1e-3
    assert s["train_s"] == pytest.approx(clock[-1], abs=1e-3)
    assert r["evals"][-1]["step"] == done and r["evals"][-1]["final"]
    timed = r["evals"][:-1]  # one each time the clock passed another multiple of `every`
    assert int(clock[-2] // every) - 1 <= len(timed) <= int(clock[-2] // every)
    for k, e in enumerate(timed, 1):
        assert clock[e["step"] - 1] < k * every + slack and k * every <= clock[e["step"]] + 1e-3
        assert e["train_s"] == pytest.approx(clock[e["step"]], abs=1e-3)
    assert s["eval_s"] > 0


def test_local_sgd_trains_and_bytes_agree_with_handle_stats(tmp_path):
    try:
        train.check_available("allreduce")
    except train.HookUnavailable as exc:
        pytest.skip(str(exc))
    r = _run("allreduce", tmp_path, ["--warmup", "6"])
    first, last = _first_last(r["steps"])
    assert last < first - 0.5, (first, last)
    steps, warmup, period = r["steps"], 6, 4
    # schedule: averages iff s >= warmup and (s - warmup) % period == 0
    assert [s["step"] for s in steps if s["averaged"]] == list(range(warmup, 40, period))
    model_bytes = 4 * r["config"]["n_params"]
    for s in steps:
        expect = model_bytes if (s["step"] < warmup or s["averaged"]) else 0
        assert s["bytes"] == expect, s
    # handle.stats counts the averaging rounds only (not warm-up gradient sync)
    stats = r["summary"]["handle_stats"]
    assert stats["rounds"] == len(range(warmup, 40, period))
    assert stats["bytes_sent"] == stats["rounds"] * model_bytes
    assert r["summary"]["median_local_step_s"] is not None


def test_period_after_switches_the_period_at_a_step(tmp_path):
    r = _run("allreduce", tmp_path, ["--period", "2", "--period-after", "10:4"])
    # rounds every 2 steps from step 0; the round at step 10 sets the next 4 steps later
    assert [s["step"] for s in r["steps"] if s["averaged"]] == [0, 2, 4, 6, 8, *range(10, 40, 4)]


def test_interleaved_fragments_train_one_fragment_a_round(tmp_path):
    r = _run("int4_streaming_interleaved", tmp_path, ["--fragments", "2"])
    first, last = _first_last(r["steps"])
    assert last < first - 0.5, (first, last)
    # period 4 in 2 fragments: a round launched every 2 steps, each sending the 4-bit
    # codes of about half the model (the last round of each fragment may still be in
    # flight at the end: at most one per fragment)
    assert [s["step"] for s in r["steps"] if s["averaged"]] == list(range(0, 40, 2))
    assert 20 - 2 <= r["summary"]["handle_stats"]["rounds"] <= 20
    _check_background_rounds(r, 0.05, 0.085)  # 4 bits of 1/2 the model: 0.067
    _check_round_waits(r)


def test_half_period_variant_launches_at_half_the_period(tmp_path):
    r = _run("int4_streaming_interleaved_half_period", tmp_path, ["--fragments", "2"])
    # --period 4 halved: period 2 in 2 fragments, a round of about half the model launched
    # at every step
    assert [s["step"] for s in r["steps"] if s["averaged"]] == list(range(40))
    _check_background_rounds(r, 0.05, 0.085)


def test_rounds_coded_at_the_launch_are_the_background_ones_bit_for_bit(tmp_path):
    # applied at the next step: the same steps see the same rounds, wherever they are coded
    extra = ["--fragments", "2", "--overlap-steps", "1"]
    background = _run("int2_streaming_interleaved", tmp_path, extra)
    at_launch = _run("int2_streaming_interleaved_coded_at_launch", tmp_path, extra)
    assert [s["loss"] for s in at_launch["steps"]] == [s["loss"] for s in background["steps"]]
    assert [e["val_loss"] for e in at_launch["evals"]] == \
        [e["val_loss"] for e in background["evals"]]
    _check_background_rounds(background, 0.025, 0.045)  # 2 bits of 1/2 the model: 0.035
    # at the launch: every round's bytes handed over by the training thread, as it launches
    sent = [s for s in at_launch["steps"] if s["bytes"]]
    assert sent and all(s["background_bytes"] == 0 for s in sent)
    assert [s["step"] for s in sent] == [s["step"] for s in at_launch["steps"] if s["averaged"]]


def _check_background_rounds(r, lo: float, hi: float) -> None:
    """Overlapped float32 rounds: every byte handed over by the background thread, none by
    the training thread, each step's bytes a whole number of rounds of ``lo``..``hi`` of
    the fp32 model (a round is sent while a later step runs, so two may fall in one)."""
    fp32 = r["summary"]["param_bytes"]
    first = next(s["step"] for s in r["steps"] if s["averaged"])  # after the warm-up
    sent = [s for s in r["steps"] if s["step"] >= first and s["bytes"]]
    assert sent and all(s["bytes"] == s["background_bytes"] for s in sent), sent[:4]
    for s in sent:
        size = s["bytes"] / fp32
        k = max(1, round(size / ((lo + hi) / 2)))
        assert lo * k < size < hi * k, (s["step"], size)


def test_the_reducer_is_off_after_the_warmup_unless_kept(tmp_path):
    # the hook sees DDP's buckets through the warm-up and the first backward after it;
    # from then on DDP skips its reducer, unless the variant keeps it running
    calls = {}
    for hook in ("int4_streaming", "int4_streaming_reducer_on"):
        r = _run(hook, tmp_path, ["--warmup", "4"])
        first, last = _first_last(r["steps"])
        assert last < first - 0.5, (hook, first, last)
        calls[hook] = [s["grad_hook_calls"] for s in r["steps"]]
    assert all(n > 0 for n in calls["int4_streaming"][:5]), calls
    assert calls["int4_streaming"][5:] == [0] * 35, calls
    assert all(n > 0 for n in calls["int4_streaming_reducer_on"]), calls


def _check_round_waits(r: dict) -> None:
    """The waits for rounds each step records are part of its averaging call, and add up
    to what the handle counted (less the rounds synchronized after the loop)."""
    steps = r["steps"]
    assert all(0.0 <= s["round_wait_s"] <= s["avg_s"] + 1e-6 for s in steps)
    total = r["summary"]["handle_stats"]["wait_seconds"]
    assert sum(s["round_wait_s"] for s in steps) <= total + 1e-3
    breakdown = r["summary"]["breakdown"]
    assert 0.0 <= breakdown["round_wait_s"] <= breakdown["avg_s"]


@pytest.mark.parametrize("hook", ["int4_streaming", "fp16_timed", "torch_localsgd", "fsdp_int8"])
def test_period_after_is_refused_where_it_would_not_apply(hook, capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(["--hook", hook, "--period-after", "10:4"])
    assert exc.value.code == 2
    assert f"--period-after: {hook} takes no changing period" in capsys.readouterr().err


@pytest.mark.parametrize("hook,bytes_per_param", [("diloco", 4), ("diloco_fp16", 2)])
def test_diloco_variants_train_and_send_their_inner_hooks_bytes(tmp_path, hook, bytes_per_param):
    r = _run(hook, tmp_path, ["--lr", "1e-3"])
    first, last = _first_last(r["steps"])
    assert last < first - 0.3, (first, last)
    stats = r["summary"]["handle_stats"]
    assert stats["rounds"] == 40 // 4  # TINY: --period 4, no warm-up
    # the outer step is local: a round sends only the inner hook's buffer
    assert stats["bytes_sent"] == stats["rounds"] * bytes_per_param * r["config"]["n_params"]
    assert [s["step"] for s in r["steps"] if s["averaged"]] == list(range(0, 40, 4))
    # blocking rounds: every averaging step waits for its round, the other steps for none
    _check_round_waits(r)
    assert all(s["round_wait_s"] > 0 for s in r["steps"] if s["averaged"])
    assert all(s["round_wait_s"] == 0 for s in r["steps"] if not s["averaged"])


@pytest.mark.torchrun
def test_hierarchical_counts_node_and_global_rounds_separately(tmp_path):
    # 4 ranks as 2 "nodes" of 2: node rounds every 2 steps, global rounds every 4 (TINY)
    r = launch.run_training([*TINY, "--hook", "hierarchical", "--intra-period", "2",
                             "--ranks-per-node", "2"], str(tmp_path / "h"), nproc=4,
                            timeout_s=180)
    first, last = _first_last(r["steps"])
    assert last < first - 0.3, (first, last)
    assert r["config"]["world_size"] == 4
    stats, model_bytes = r["summary"]["handle_stats"], 4 * r["config"]["n_params"]
    assert stats["rounds"] == 10 and stats["bytes_sent"] == 10 * model_bytes
    assert stats["node"]["rounds"] == 20 and stats["node"]["bytes_sent"] == 20 * model_bytes
    assert r["summary"]["per_rank_bytes"] == [30 * model_bytes] * 4


def test_delayed_hook_holds_results_back_and_keeps_hook_attributes():
    import time

    import torch

    def hook(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(torch.ones(3))
        return fut
    import ddp_avg_hooks as dah

    dah.averaging_hook(hook, needs_anchor=True)
    delayed = train.delayed_hook(hook, 0.2)
    assert dah.hook_spec(delayed).needs_anchor and delayed.__name__ == "hook"
    t0 = time.perf_counter()
    fut = delayed(None, None)
    assert not fut.done()
    assert torch.equal(fut.wait(), torch.ones(3)) and time.perf_counter() - t0 >= 0.2

    def failing(state, bucket):
        fut = torch.futures.Future()
        fut.set_exception(ValueError("boom"))
        return fut
    with pytest.raises(ValueError, match="boom"):
        train.delayed_hook(failing, 0.01)(None, None).wait()


def test_unknown_or_missing_hook_is_a_clear_error(monkeypatch):
    with pytest.raises(train.HookUnavailable, match="unknown"):
        train.check_available("nope")
    import ddp_avg_hooks as dah
    monkeypatch.delattr(dah.hooks, "allreduce_hook")
    with pytest.raises(train.HookUnavailable, match="allreduce_hook is not available"):
        train.check_available("allreduce")


def test_corpus_is_deterministic_and_split():
    a = train.load_corpus(100_000)
    b = train.load_corpus(100_000)
    assert len(a) == 100_000 and bool((a == b).all())
    tr, va = train.split(a, 0.1)
    assert len(tr) == 90_000 and len(va) == 10_000 and bool((va == a[-10_000:]).all())


def test_parse_args_preset_and_overrides():
    a = train.parse_args(["--preset", "tiny", "--d-model", "48"])
    assert a.d_model == 48 and a.n_layers == train.PRESETS["tiny"]["n_layers"]


def test_split_available_keeps_runnable_variants_and_says_why_not():
    ok, not_run = train.split_available("ddp,nope,diloco")
    assert ok == ["ddp", "diloco"]
    assert len(not_run) == 1 and not_run[0].startswith("nope: ") and "unknown" in not_run[0]


def test_rounds_at_a_fixed_step_repeat_the_run(tmp_path):
    # overlap_steps=1: every round lands at the step after its launch, so a second run
    # of the seed gives the same losses, validation included
    runs = [_run("int4_streaming_interleaved_next_step", tmp_path / str(i), ["--fragments", "2"])
            for i in range(2)]
    assert [s["step"] for s in runs[0]["steps"] if s["averaged"]] == list(range(0, 40, 2))
    assert runs[0]["summary"]["handle_stats"]["rounds"] == 20
    for key, field in (("steps", "loss"), ("evals", "val_loss")):
        assert [s[field] for s in runs[0][key]] == [s[field] for s in runs[1][key]], key
