"""Ranks that register differently: every setting that changes the collectives or the
result is refused on every rank, naming the setting, the values and the ranks; what does
not change them is harmless. Property-based (Hypothesis, derandomized, so every rank
draws the same examples), on 2 and 3 gloo ranks, with a short process-group timeout:
a hang or an abort fails the test."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import flat, train_step

h = dah.hooks
HOOKS = {
    "allreduce": (h.allreduce_hook, lambda s: None),
    "fp16": (h.fp16_compress_hook, lambda s: h.HalfDeltaState(**s)),
    "int8": (h.int8_compress_hook, lambda s: h.QuantizedDeltaState(**s)),
    "powersgd": (h.powersgd_hook, lambda s: h.PowerSGDState(**s)),
    "diloco": (h.outer_optimizer(h.allreduce_hook), lambda s: h.OuterOptimizerState(None, **s)),
}
# the state settings each hook takes, and values to draw
STATE_FIELDS = {
    "fp16": {"error_feedback": [True, False], "residual_dtype": [torch.bfloat16, None]},
    "int8": {"block_size": [128, 16], "error_feedback": [True, False]},
    "powersgd": {"matrix_approximation_rank": [1, 2], "start_powersgd_round": [0, 2],
                 "min_compression_rate": [2.0, 0.0], "warm_start": [True, False],
                 "seed": [0, 5]},
    "diloco": {"lr": [0.7, 0.5], "momentum": [0.9, 0.5]},
}
OPTION_FIELDS = {
    "period": [2, 3], "warmup_steps": [0, 1], "bucket_cap_mb": [25.0, 64 / 2**20],
    "check_finite": [False, True], "verify": [False, True], "overlap": [False, True],
    "track_consensus": [False, True], "average_buffers": [False, True],
    "optimizer_state": ["keep", "average", "reset"], "fragments": [1, 2],
    "fragment_layout": ["contiguous", "interleaved"],
    "mixing": [None, 0.5], "overlap_steps": [None, 1], "keep_anchor": [None, True],
    # not agreed: they change neither the collectives nor the result
    "zero_copy": [False, True], "offload_state": [False, True], "on_round": [None, "count"],
}
HARMLESS = {"zero_copy", "offload_state", "on_round"}
STEPS = 7


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6),
                               torch.nn.Linear(6, 3))


def _register(config):
    ddp = DDP(_model(), broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    hook, make_state = HOOKS[config["hook"]]
    options = dict(config["options"])
    if options.get("on_round") == "count":
        options["on_round"] = lambda handle: None
    handle = dah.register_averaging_hook(ddp, hook, make_state(config["state"]),
                                         optimizer=opt, **options)
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    return ddp, opt, handle


def _run(rank, config):
    """``("refused", message)`` or ``("ran", final parameters)``."""
    try:
        ddp, opt, handle = _register(config)
    except dah.errors.SettingsMismatchError as exc:
        return "refused", str(exc)
    for step in range(STEPS):
        train_step(ddp, opt, rank, step)
        # when an overlapped round lands depends on timing: apply it at once, so that two
        # runs apply it at the same step
        handle.synchronize()
    out = flat(ddp.module)
    handle.remove()
    return "ran", out


def _valid(config) -> bool:
    """Whether a configuration registers on its own (checked before any rank uses it)."""
    try:
        options = dict(config["options"])
        options.pop("on_round", None)
        if options.get("optimizer_state", "keep") != "keep":
            options["optimizer"] = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        dah.AveragingOptions(**options)
        HOOKS[config["hook"]][1](config["state"])
    except (TypeError, ValueError):
        return False
    return True


def _rank_property(rank, world_size, examples):
    from hypothesis import HealthCheck, assume, given, settings, strategies as st

    @st.composite
    def cases(draw):
        hook = draw(st.sampled_from(sorted(HOOKS)))
        state = {k: draw(st.sampled_from(v)) for k, v in STATE_FIELDS.get(hook, {}).items()}
        options = {k: draw(st.sampled_from(v)) for k, v in OPTION_FIELDS.items()}
        fields = ["hook", *[f"state.{k}" for k in STATE_FIELDS.get(hook, {})], *OPTION_FIELDS]
        field = draw(st.sampled_from(fields))
        other = {"hook": hook, "state": dict(state), "options": dict(options)}
        if field == "hook":
            other["hook"] = draw(st.sampled_from([n for n in HOOKS if n != hook]))
            other["state"] = {k: v[0] for k, v in STATE_FIELDS.get(other["hook"], {}).items()}
        elif field.startswith("state."):
            name = field.split(".", 1)[1]
            other["state"][name] = draw(st.sampled_from(
                [v for v in STATE_FIELDS[hook][name] if v != state[name]]))
        else:
            other["options"][field] = draw(st.sampled_from(
                [v for v in OPTION_FIELDS[field] if v != options[field]]))
        base = {"hook": hook, "state": state, "options": options}
        return base, other, field

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def check(case):
        base, other, field = case
        assume(_valid(base) and _valid(other))
        mine = other if rank == 1 else base
        outcomes = [None] * world_size
        dist.all_gather_object(outcomes, _run(rank, mine))
        reference = [None] * world_size
        dist.all_gather_object(reference, _run(rank, base))
        name = field.split(".", 1)[-1]
        if field.startswith("state.") and base["hook"] == "diloco":
            name = f"outer_{name}"
        effective_same = field == "keep_anchor" and (
            base["hook"] != "allreduce" or base["options"]["overlap"])
        if field in HARMLESS or effective_same:  # the same run as the base one, bit for bit
            for got, ref in zip(outcomes, reference):
                assert got[0] == "ran" and torch.equal(got[1], ref[1]), (field, got[0])
        else:  # refused on every rank, naming the setting and the rank
            for kind, message in outcomes:
                assert kind == "refused", (field, kind)
                assert f"ranks disagree on {name!r}" in message and "ranks [1]" in message, \
                    (field, message)

    check()
    return "ok"


@pytest.mark.slow
@pytest.mark.parametrize("world_size, examples", [(2, 100), (3, 40)])
def test_every_disagreement_is_refused_or_harmless(world_size, examples):
    assert run_ranks(_rank_property, world_size, timeout_s=300, pg_timeout_s=5,
                     examples=examples) == ["ok"] * world_size


# each setting the ranks must share, with rank 1's value; (hook, state kwargs, options)
LISTED = {
    "block_size": ("int8", {"block_size": 64}, {}),
    "error_feedback": ("int8", {"error_feedback": False}, {}),
    "matrix_approximation_rank": ("powersgd", {"matrix_approximation_rank": 2}, {}),
    "start_powersgd_round": ("powersgd", {"start_powersgd_round": 3}, {}),
    "outer_lr": ("diloco", {"lr": 0.5}, {}),
    "outer_momentum": ("diloco", {"momentum": 0.0}, {}),
    # another class, whose own settings (Adam's amsgrad, ...) the other side lacks
    "outer_optimizer": ("diloco", {"optimizer": torch.optim.Adam}, {}),
    "residual_dtype": ("fp16", {"residual_dtype": None}, {}),
    "track_consensus": ("allreduce", {}, {"track_consensus": True}),
    "verify": ("allreduce", {}, {"verify": True}),
    "optimizer_state": ("allreduce", {}, {"optimizer_state": "average"}),
    "average_buffers": ("allreduce", {}, {"average_buffers": True}),
    "mixing": ("fp16", {}, {"overlap": True, "mixing": 0.5}),
    "overlap_steps": ("fp16", {}, {"overlap": True, "overlap_steps": 1}),
    "fragments": ("allreduce", {}, {"fragments": 2}),
    "fragment_layout": ("allreduce", {}, {"fragments": 2, "fragment_layout": "interleaved"}),
    "bucket_cap_mb": ("allreduce", {}, {"bucket_cap_mb": 1.0}),
    "check_finite": ("allreduce", {}, {"check_finite": True}),
}


def _rank_listed(rank, world_size):
    out = {}
    for setting, (hook, state, options) in LISTED.items():
        shared = {"period": 2, "overlap": options.get("overlap", False)}
        if "fragment_layout" in options:  # the same fragments, dealt another way
            shared["fragments"] = options["fragments"]
        if rank == 1:
            config = {"hook": hook, "state": state, "options": {**shared, **options}}
        else:
            config = {"hook": hook, "state": {}, "options": shared}
        out[setting] = _run(rank, config)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_listed_setting_is_refused_on_every_rank_naming_it(world_size):
    for rank, out in enumerate(run_ranks(_rank_listed, world_size, timeout_s=120, pg_timeout_s=5)):
        for setting, (kind, message) in out.items():
            assert kind == "refused", (rank, setting)
            assert f"ranks disagree on {setting!r}" in message, (rank, setting, message)
            assert "ranks [1]" in message and "on rank 1" in message, (rank, setting, message)


def test_a_checkpoint_with_other_settings_is_refused_naming_the_setting(world1):
    _, _, saved_by = _register({"hook": "int8", "state": {"block_size": 64},
                                "options": {"period": 2}})
    saved = saved_by.state_dict()
    saved_by.remove()
    # other fragments or buckets also give entries of other lengths: the setting is named,
    # not a "damaged" entry
    for hook, state, options, says in (
            ("int8", {"block_size": 128}, {}, "'block_size' differs"),
            ("int8", {"block_size": 64}, {"track_consensus": True}, "'track_consensus' differs"),
            ("int8", {"block_size": 64}, {"fragments": 2}, "'fragments' differs: 1 there, 2"),
            ("int8", {"block_size": 64}, {"bucket_cap_mb": 1e-5},
             "'bucket_cap_mb' differs: 25.0 there")):
        _, _, handle = _register({"hook": hook, "state": state,
                                  "options": {"period": 2, **options}})
        with pytest.raises(dah.errors.SettingsMismatchError, match=says):
            handle.load_state_dict(saved)
        assert handle.step_count == 0  # nothing loaded
        handle.remove()


def _rank_verify_fragments(rank, world_size):
    """Each fragment round's check compares the buckets it averaged (blocking and overlapped)."""
    rounds = []
    for options in ({"period": 2, "fragments": 2, "verify": True},
                    {"period": 4, "fragments": 2, "verify": True, "overlap": True}):
        ddp, opt, handle = _register({"hook": "fp16", "state": {}, "options": options})
        for step in range(9):
            train_step(ddp, opt, rank, step)
        handle.synchronize()
        rounds.append(handle.stats.rounds)
        handle.remove()
    return rounds


def test_verify_compares_the_buckets_a_fragment_round_averaged():
    assert run_ranks(_rank_verify_fragments, 2, timeout_s=60) == [[9, 5]] * 2


def _rank_optimizer_state_differs(rank, world_size):
    """Adam on one rank, SGD with momentum on the other, their state averaged at each round."""
    out = []
    for overlap in (False, True):
        ddp = DDP(_model(), broadcast_buffers=False)
        opt = (torch.optim.Adam(ddp.parameters(), lr=0.01) if rank == 1
               else torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9))
        handle = dah.register_averaging_hook(ddp, h.allreduce_hook, None, period=2,
                                             overlap=overlap, optimizer_state="average",
                                             optimizer=opt)
        handle.detach_optimizer()  # stepped by hand, to see the parameters around the round
        train_step(ddp, opt, rank, 0)
        before = flat(ddp)
        try:
            handle.step()  # the first round
            out.append(("averaged", handle.stats.rounds))
        except dah.errors.SettingsMismatchError as exc:
            out.append((str(exc), torch.equal(flat(ddp), before), handle.stats.rounds))
        handle.remove()
    return out


def test_optimizer_state_that_differs_between_ranks_is_refused_before_it_is_sent():
    # without the check the state buckets' sizes differ: gloo aborts the process or hangs
    for per_rank in run_ranks(_rank_optimizer_state_differs, 2, timeout_s=90, pg_timeout_s=15):
        for message, unchanged, rounds in per_rank:
            assert "round 1, step 0: the ranks' optimizer state" in message
            assert ("'0.weight' holds [('momentum_buffer', (6, 5))] on rank 0, "
                    "[('exp_avg', (6, 5)), ('exp_avg_sq', (6, 5))] on rank 1") in message
            assert "optimizer_state='keep'" in message
            assert unchanged and rounds == 0


def _rank_other_group(rank, world_size):
    pair = dist.new_group([0, 1])  # the same members as the world, another communicator
    config = {"hook": "allreduce", "state": {}, "options": {"period": 2}}
    config["options"]["process_group"] = pair if rank == 1 else dist.group.WORLD
    try:
        _register(config)
    except RuntimeError as exc:
        return str(exc)
    return "registered"


def test_ranks_naming_different_groups_fail_within_the_timeout_saying_so():
    for message in run_ranks(_rank_other_group, 2, timeout_s=60, pg_timeout_s=3,
                             hard_exit=True):
        assert "could not exchange settings" in message and "with the same group?" in message


def test_a_restartable_torchrun_without_the_store_setting_is_warned_about(world1, monkeypatch):
    from ddp_avg_hooks import registry

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    with pytest.warns(UserWarning, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        _register({"hook": "allreduce", "state": {}, "options": {}})[2].remove()
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    assert not registry.warn_on_shared_elastic_store()
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    assert not registry.warn_on_shared_elastic_store()


def test_a_checkpoint_from_before_fragment_layouts_loads_as_contiguous(world1):
    options = {"period": 4, "fragments": 2}
    ddp, opt, saved_by = _register({"hook": "int8", "state": {}, "options": options})
    for step in range(3):
        train_step(ddp, opt, 0, step)
    saved = saved_by.state_dict()
    saved_by.remove()
    del saved["config"]["fragment_layout"]  # written before the setting existed
    _, _, handle = _register({"hook": "int8", "state": {},
                              "options": {**options, "fragment_layout": "interleaved"}})
    with pytest.raises(dah.errors.SettingsMismatchError, match="'fragment_layout' differs"):
        handle.load_state_dict(saved)
    handle.remove()
    _, _, handle = _register({"hook": "int8", "state": {}, "options": options})
    handle.load_state_dict(saved)
    assert handle.step_count == 3
    handle.remove()

