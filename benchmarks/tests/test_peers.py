"""The other libraries' local SGD in the training benchmark: a few tiny steps of each.

torchrun, 2 CPU ranks on loopback, the ``tiny`` preset; skipped (with the reason the
harness reports) when the package is not installed.
"""
from __future__ import annotations

import pytest

from harness import launch, peers, train

TINY = ["--preset", "tiny", "--steps", "8", "--eval-every", "0", "--period", "4",
        "--progress", "off", "--corpus-bytes", "200000", "--timeout", "60"]


@pytest.fixture(autouse=True)
def _no_extension_build(monkeypatch):
    monkeypatch.setenv("DDP_AVG_HOOKS_DISABLE_EXT", "1")


def _run(hook: str, tmp_path, extra=()) -> dict:
    try:
        train.check_available(hook)
    except train.HookUnavailable as exc:
        pytest.skip(str(exc))
    return launch.run_training([*TINY, "--hook", hook, *extra], str(tmp_path / hook),
                               timeout_s=90)


@pytest.mark.torchrun
def test_torchft_diloco_syncs_every_period_through_its_manager(tmp_path):
    r = _run("torchft_diloco", tmp_path)
    steps, model_bytes = r["steps"], 4 * r["config"]["n_params"]
    # torchft's schedule: after steps period, 2 * period, ... (0-based 3, 7)
    assert [s["step"] for s in steps if s["averaged"]] == [3, 7]
    # the pseudo-gradient of every parameter, through the Manager's all-reduce
    assert [s["bytes"] for s in steps] == [0, 0, 0, model_bytes] * 2
    assert all(s["comm_s"] > 0 for s in steps if s["averaged"])
    assert r["summary"]["per_rank_bytes"] == [2 * model_bytes] * 2


@pytest.mark.parametrize("variant, first", [("torchft_streaming_diloco", 1),
                                            ("diloco_streaming", 0)])
def test_streaming_diloco_syncs_one_fragment_at_a_time(tmp_path, variant, first):
    # a fragment every period / fragments steps, two of them make the model: torchft's
    # after its steps, ours at fragment f's steps f * period / K + n * period
    r = _run(variant, tmp_path, ["--fragments", "2"])
    steps, model_bytes = r["steps"], 4 * r["config"]["n_params"]
    sent = [s["bytes"] for s in steps]
    at = [first + 2 * i for i in range(4)]
    assert [s["step"] for s in steps if s["averaged"]] == at
    assert sent[at[0]] + sent[at[1]] == sent[at[2]] + sent[at[3]] == model_bytes
    assert 0 < sent[at[0]] < model_bytes
    assert sum(sent) == 2 * model_bytes
    if variant == "diloco_streaming":
        assert r["summary"]["handle_stats"]["bytes_sent"] == 2 * model_bytes


def test_accelerate_localsgd_averages_every_period(tmp_path):
    r = _run("accelerate_localsgd", tmp_path)
    steps, model_bytes = r["steps"], 4 * r["config"]["n_params"]
    # accelerate: no_sync() keeps gradients local; parameters averaged after steps 4, 8
    assert [s["step"] for s in steps if s["averaged"]] == [3, 7]
    assert [s["bytes"] for s in steps] == [0, 0, 0, model_bytes] * 2


def test_peer_fragments_are_contiguous_and_tied_weights_counted_once():
    import torch

    model = train.CharTransformer(32, 2, 2, 16)
    frags = peers.module_fragments(model, 3)
    params = [p for f in frags for p in f.parameters()]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    sizes = [sum(p.numel() for p in f.parameters()) for f in frags]
    assert max(sizes) < 2 * min(sizes), sizes
    with pytest.raises(ValueError, match="fragments of a model"):
        peers.module_fragments(torch.nn.Linear(2, 2), 2)


def test_missing_package_makes_a_peer_unavailable(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    ok, why = train.split_available("torchft_diloco,none")
    assert ok == ["none"]
    assert why[0].startswith(
        "torchft_diloco: --hook torchft_diloco: needs torchft (ModuleNotFoundError")
    assert "pip install 'ddp_avg_hooks[peers]'" in why[0]


