"""Local SGD over FSDP2 shards, HSDP built by hand: 4 gloo ranks make 2 replica groups of 2
shards (and 2 ranks make 2 replicas of 1 shard), checked against a single-process
reference of the same schedule and against the DDP path.

The model (``tests/_fsdp.py``) has a layer whose rows do not divide by the shard count
and one whose second shard is empty.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
import _fsdp as F
from _dist import run_ranks
from _helpers import late, make_model

pytestmark = pytest.mark.slow
h = dah.hooks
WARMUP, PERIOD, STEPS = 2, 3, 9
ROUNDS = {s for s in range(STEPS) if s >= WARMUP and (s - WARMUP) % PERIOD == 0}


def _train(rank, hook, state, *, steps=STEPS, rounds=None, shards=2, opt_cls=torch.optim.SGD,
           opt_kw=None, grad_hooks=True, synchronize=False, **options):
    """Train the sharded model (``steps`` steps, or until ``rounds`` rounds started); the
    full parameters and local shards after every step."""
    model, replicate = F.sharded_model(shards)
    opt = opt_cls(model.parameters(), **(opt_kw or {"lr": 0.05}))
    if callable(state) and not isinstance(state, torch.distributed.ProcessGroup):
        state = state(replicate)
    handle = dah.register_averaging_hook(model, hook, state, period=options.pop("period", PERIOD),
                                         warmup_steps=WARMUP, optimizer=opt, **options)
    if grad_hooks:
        dah.grad_hooks.register_fsdp_grad_hooks(model, handle)
    full, local = [], []
    step = 0
    while (handle.rounds_started < rounds) if rounds else step < steps:
        F.train_step(model, opt, rank, step)
        step += 1
        if synchronize:
            handle.synchronize()
        full.append(F.full_params(model))
        local.append(F.local_shards(model))
    out = {"full": full, "local": local, "rounds": handle.stats.rounds,
           "bytes": handle.stats.bytes_sent, "memory": handle.memory_bytes(),
           "anchors": [b.stored_anchor().clone() for b in handle.buckets if b.has_anchor()],
           "opt_state": [{k: dah.models.local_tensor(v).clone() for k, v in s.items()}
                         for s in opt.state.values()],
           "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters())}
    handle.remove()
    return out


HOOKS = {
    "allreduce": (h.allreduce_hook, lambda g: g, {}),
    "fp16": (h.fp16_compress_hook, lambda g: h.HalfDeltaState(process_group=g), {}),
    "bf16": (h.bf16_compress_hook, lambda g: g, {}),
    "int8": (h.int8_compress_hook, lambda g: h.QuantizedDeltaState(block_size=4, process_group=g),
             {}),
    "int4": (h.int4_compress_hook, lambda g: h.QuantizedDeltaState(block_size=4, process_group=g),
             {}),
    # full rank on every row-block (min_compression_rate 0): the exact average
    "powersgd": (h.powersgd_hook, lambda g: h.PowerSGDState(
        g, matrix_approximation_rank=8, min_compression_rate=0.0), {}),
    # outer SGD at lr 1 without momentum: the inner average itself
    "outer_plain": (h.outer_optimizer(h.allreduce_hook),
                    lambda g: h.OuterOptimizerState(g, lr=1.0, momentum=0.0), {}),
    "diloco": (h.outer_optimizer(h.fp16_compress_hook),
               lambda g: h.OuterOptimizerState(h.HalfDeltaState(process_group=g)), {}),
    "offload": (h.fp16_compress_hook, lambda g: g, {"offload_state": True}),
}
# absolute error of the full parameters against the exact reference (a few rounds)
BOUNDS = {"allreduce": 1e-6, "powersgd": 1e-5, "outer_plain": 1e-6, "fp16": 2e-3,
          "bf16": 1e-2, "offload": 2e-3, "int8": 2e-2, "int4": 2e-1}


def _rank_hooks(rank, world_size):
    return {name: _train(rank, hook, state, **opts) for name, (hook, state, opts) in HOOKS.items()}


@pytest.fixture(scope="module")
def hook_runs():
    return run_ranks(_rank_hooks, 4, timeout_s=300)


def test_exact_hook_follows_the_reference_and_replicas_agree_only_at_rounds(hook_runs):
    ref = F.reference(4, 2, STEPS, ROUNDS, warmup=WARMUP)
    for rank, run in enumerate(hook_runs):
        replica = rank // 2
        for step, full in enumerate(run["allreduce"]["full"]):
            torch.testing.assert_close(full, ref[step][replica], rtol=0, atol=1e-6)
        assert run["allreduce"]["rounds"] == len(ROUNDS)
    for step in range(STEPS):
        a, b = hook_runs[0]["allreduce"]["full"][step], hook_runs[2]["allreduce"]["full"][step]
        if step < WARMUP or step in ROUNDS:  # gradients averaged, or just averaged
            assert torch.equal(a, b), step
        else:
            assert not torch.equal(a, b), step


@pytest.mark.parametrize("name", [n for n in HOOKS if n in BOUNDS])
def test_every_hook_stays_within_its_bound_of_the_exact_reference(hook_runs, name):
    ref = F.reference(4, 2, STEPS, ROUNDS, warmup=WARMUP)
    for rank, run in enumerate(hook_runs):
        for step in sorted(ROUNDS):
            err = float((run[name]["full"][step] - ref[step][rank // 2]).abs().max())
            assert err <= BOUNDS[name], (name, rank, step, err)
        # the shards of the same rank index agree bit for bit right after each round
        peer = hook_runs[rank ^ 2][name]
        for step in sorted(ROUNDS):
            assert torch.equal(run[name]["local"][step], peer["local"][step]), (name, step)


def test_the_outer_optimizer_keeps_replicas_identical(hook_runs):
    for rank in (0, 1):
        a, b = hook_runs[rank]["diloco"], hook_runs[rank + 2]["diloco"]
        for step in sorted(ROUNDS):
            assert torch.equal(a["local"][step], b["local"][step])
        assert a["rounds"] == len(ROUNDS)


def test_offloaded_state_gives_the_device_states_bits(hook_runs):
    for run in hook_runs:
        for a, b in zip(run["offload"]["local"], run["fp16"]["local"]):
            assert torch.equal(a, b)


def test_memory_is_counted_against_the_local_shard(hook_runs):
    for run in hook_runs:
        for name, limit in (("allreduce", 1.05), ("fp16", 2.0)):
            report, shard = run[name]["memory"], run[name]["shard_bytes"]
            assert dah.memory.total(report) <= limit * shard, (name, report, shard)
        device = run["offload"]["memory"]
        assert set(device["anchors"]) == {"cpu"}  # host memory (a CPU run: the same device)


def _rank_streaming(rank, world_size):
    out = {}
    for name, hook, opts in (
            ("fragments", h.allreduce_hook, {"fragments": 2, "period": 4}),
            ("overlap_mixing", h.fp16_compress_hook, {"overlap": True, "mixing": 0.5}),
            ("fragments_overlap", h.int8_compress_hook,
             {"fragments": 2, "overlap": True, "period": 4}),
            ("interleaved", h.int8_compress_hook,
             {"fragments": 2, "overlap": True, "period": 4, "fragment_layout": "interleaved"}),
            ("fixed_step", h.int8_compress_hook,
             {"fragments": 2, "overlap": True, "period": 4, "overlap_steps": 1}),
            # the same with each round's result 0.2 s late, several steps of this model
            ("fixed_step_late", late(h.int8_compress_hook, 0.2),
             {"fragments": 2, "overlap": True, "period": 4, "overlap_steps": 1}),
            ("timed", h.allreduce_hook, {"period": dah.schedules.EverySeconds(0.05),
                                         "rounds": 4})):
        # rounds applied at the step after their launch need no synchronize() to repeat
        out[name] = _train(rank, hook, lambda g: g, steps=12, **opts,
                           synchronize=name not in ("timed", "fixed_step", "fixed_step_late"))
    # time-based rounds: the ranks of a replica group start the same rounds at the same steps
    out["timed_steps"] = len(out["timed"]["full"])
    # optimizer state averaged across replicas (DTensor Adam moments)
    out["adam_average"] = _train(rank, h.allreduce_hook, lambda g: g, opt_cls=torch.optim.Adam,
                                 opt_kw={"lr": 0.01}, optimizer_state="average")
    out["adam_keep"] = _train(rank, h.allreduce_hook, lambda g: g, opt_cls=torch.optim.Adam,
                              opt_kw={"lr": 0.01})
    return out


def test_fragments_overlap_mixing_time_based_rounds_and_optimizer_state():
    runs = run_ranks(_rank_streaming, 4, timeout_s=300)
    for rank in (0, 1):
        mine, peer = runs[rank], runs[rank + 2]
        for name in ("fragments", "overlap_mixing", "fragments_overlap", "interleaved", "timed",
                     "fixed_step"):
            assert mine[name]["rounds"] == peer[name]["rounds"] >= 2, name
            # the replicas agree on what the rounds averaged: the anchors
            for a, b in zip(mine[name]["anchors"], peer[name]["anchors"]):
                assert torch.equal(a, b), name
        # every 4 steps each of the 2 fragments once: (12 - WARMUP) // 2 rounds
        assert mine["fragments"]["rounds"] == 5
        assert not mine["fragments"]["anchors"]  # the exact hook keeps no anchor
        assert runs[rank]["timed_steps"] == runs[rank ^ 1]["timed_steps"]  # its shard peer
        # overlap_steps: rounds that arrive late give the same parameters after every step
        for a, b in zip(mine["fixed_step"]["full"], mine["fixed_step_late"]["full"]):
            assert torch.equal(a, b)
        for a, b in zip(mine["adam_average"]["opt_state"], peer["adam_average"]["opt_state"]):
            assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))
        keep = [torch.equal(a["exp_avg"], b["exp_avg"])
                for a, b in zip(mine["adam_keep"]["opt_state"], peer["adam_keep"]["opt_state"])]
        assert not all(keep)  # without the policy the replicas' moments drift apart


def _rank_one_shard(rank, world_size, kind):
    """2 replicas of 1 shard (FSDP2) or 2 DDP ranks: the same schedule."""
    if kind == "fsdp":
        model, replicate = F.sharded_model(1)
        state = replicate
    else:
        model, state = DDP(make_model(0, F.DIMS)), None
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    handle = dah.register_averaging_hook(model, h.fp16_compress_hook, state, period=PERIOD,
                                         warmup_steps=WARMUP, optimizer=opt)
    if kind == "fsdp":
        dah.grad_hooks.register_fsdp_grad_hooks(model, handle)
    else:
        model.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    out = []
    for step in range(STEPS):
        F.train_step(model, opt, rank, step)
        out.append(F.full_params(model) if kind == "fsdp" else
                   torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    handle.remove()
    return out


def test_one_shard_per_replica_is_the_ddp_path_bit_for_bit():
    fsdp = run_ranks(_rank_one_shard, 2, timeout_s=120, kind="fsdp")
    ddp = run_ranks(_rank_one_shard, 2, timeout_s=120, kind="ddp")
    for rank in range(2):
        for step in range(STEPS):
            assert torch.equal(fsdp[rank][step], ddp[rank][step]), (rank, step)


def _rank_refusals(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    messages = {}
    # the whole world as the group: ranks 0 and 1 hold different shards
    model, _ = F.sharded_model(2)
    try:
        dah.register_averaging_hook(model, h.allreduce_hook, None, period=2)
    except ValueError as exc:
        messages["wrong_group"] = str(exc)
    # native HSDP: a 2-D mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = make_model(0, F.DIMS)
    fully_shard(hsdp, mesh=mesh)
    try:
        dah.register_averaging_hook(hsdp, h.allreduce_hook, None)
    except ValueError as exc:
        messages["hsdp"] = str(exc)
    try:
        dah.grad_hooks.register_fsdp_grad_hooks(make_model(), None)
    except TypeError as exc:
        messages["grad_hooks_handle"] = str(exc)
    # another FSDP2 model's handle: its warm-up would never average this model's gradients
    model, replicate = F.sharded_model(2)
    other, _ = F.sharded_model(2, seed=1)
    handle = dah.register_averaging_hook(model, h.allreduce_hook, replicate, period=2)
    try:
        dah.grad_hooks.register_fsdp_grad_hooks(other, handle)
    except ValueError as exc:
        messages["other_model"] = str(exc)
    # Join: a rank out of inputs cannot stand in for FSDP2's all-gathers
    from torch.distributed.algorithms.join import Join
    try:
        Join([handle])
    except ValueError as exc:
        messages["join"] = str(exc)
    handle.remove()
    return messages


def test_wrong_groups_and_native_hsdp_are_refused_on_every_rank():
    for messages in run_ranks(_rank_refusals, 4, timeout_s=120):
        assert "parameter '0.weight' is sharded differently" in messages["wrong_group"]
        assert "shard index" in messages["wrong_group"]
        assert "2-D mesh" in messages["hsdp"] and "mesh['shard']" in messages["hsdp"]
        assert "must be the AveragingHandle" in messages["grad_hooks_handle"]
        assert "the handle averages another model" in messages["other_model"]
        assert "Join([...]) with the handle of an FSDP2 model" in messages["join"]


def _rank_one_rank_differs(rank, world_size):
    model, replicate = F.sharded_model(2)
    try:  # rank 1 (replicate group {1, 3}) registers another period
        dah.register_averaging_hook(model, h.allreduce_hook, replicate,
                                    period=3 if rank == 1 else 2)
    except dah.errors.SettingsMismatchError as exc:
        return str(exc)
    return "registered"


def test_a_setting_that_differs_on_one_rank_stops_every_replicate_group():
    # the refusing group's ranks name the setting; the other group's stop with them,
    # rather than train on and fail in FSDP2's all-gathers once the others are gone
    messages = run_ranks(_rank_one_rank_differs, 4, timeout_s=120)
    for r in (1, 3):
        assert "ranks disagree on 'period'" in messages[r], messages[r]
    for r in (0, 2):
        assert "the ranks of another replicate group" in messages[r], messages[r]


@pytest.mark.filterwarnings("ignore::FutureWarning")  # FSDP1's deprecation notice
def test_fsdp1_and_other_models_are_refused_with_the_fsdp2_recipe(world1):
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp1 = FullyShardedDataParallel(make_model(), device_id=torch.device("cpu"))
    with pytest.raises(TypeError, match="FSDP1 .* not supported.*fully_shard"):
        dah.register_averaging_hook(fsdp1, h.allreduce_hook, None)
    with pytest.raises(TypeError, match="or an FSDP2 module"):
        dah.register_averaging_hook(make_model(), h.allreduce_hook, None)


def _rank_checkpoint(rank, world_size, ckpt_dir, stop_at=None, resume=False):
    from ddp_avg_hooks.checkpoint import RoundCheckpointer

    model, replicate = F.sharded_model(2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    handle = dah.register_averaging_hook(model, h.fp16_compress_hook, replicate, period=PERIOD,
                                         warmup_steps=WARMUP, optimizer=opt)
    dah.grad_hooks.register_fsdp_grad_hooks(model, handle)
    ckpt = RoundCheckpointer(ckpt_dir, handle, model, opt)
    restored = ckpt.restore() if resume else None
    for step in range(handle.step_count, STEPS + 3):
        if step == stop_at:
            ckpt.save()  # mid-period: replicas differ, each rank keeps its own shards
            break
        F.train_step(model, opt, rank, step)
        ckpt.maybe_save()
    state = [{k: dah.models.local_tensor(v).clone() for k, v in s.items()}
             for s in opt.state.values()]
    out = {"full": F.full_params(model), "local": F.local_shards(model), "opt": state,
           "restored": restored, "steps": handle.step_count, "rounds": handle.stats.rounds}
    handle.remove()
    return out


def test_a_mid_period_checkpoint_resumes_bit_identically_in_fresh_processes(tmp_path):
    straight = run_ranks(_rank_checkpoint, 4, timeout_s=120, ckpt_dir=str(tmp_path / "a"))
    run_ranks(_rank_checkpoint, 4, timeout_s=120, ckpt_dir=str(tmp_path / "b"), stop_at=7)
    files = sorted(p.name for p in (tmp_path / "b" / "round-00000002").iterdir())
    assert [f for f in files if f.startswith("model")] == [f"model_rank{r}.pt" for r in range(4)]
    for path in (tmp_path / "b").rglob("*.pt"):  # local shards, plain tensors: weights_only
        torch.load(path, weights_only=True)
    resumed = run_ranks(_rank_checkpoint, 4, timeout_s=120, ckpt_dir=str(tmp_path / "b"),
                        resume=True)
    for r in range(4):
        assert resumed[r]["restored"] == 2 and resumed[r]["steps"] == straight[r]["steps"]
        assert torch.equal(resumed[r]["local"], straight[r]["local"])
        assert torch.equal(resumed[r]["full"], straight[r]["full"])
        for a, b in zip(resumed[r]["opt"], straight[r]["opt"]):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_fsdp2_example_runs_and_resumes_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "fsdp2.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def torchrun(*args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", script, "--dir", str(tmp_path), *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr[-4000:]
        return r.stdout

    first = torchrun("--steps", "30")
    assert "round 3: replicas differ by 0.0e+00" in first and "replicas agreed" in first
    second = torchrun("--steps", "40")
    assert "resumed round 3 at step 27" in second and "round 4:" in second


def _rank_warmup_without_grad_hooks(rank, world_size):
    """int8 rounds after a warm-up with no cross-replica gradient averaging (the grad
    hooks forgotten): each replica group warmed up on its own batches."""
    import warnings

    import torch.distributed as dist

    model, replicate = F.sharded_model(2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    handle = dah.register_averaging_hook(model, h.int8_compress_hook,
                                         h.QuantizedDeltaState(process_group=replicate),
                                         period=PERIOD, warmup_steps=WARMUP, optimizer=opt)
    gaps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(WARMUP + 2 * PERIOD):
            F.train_step(model, opt, rank, step)
            if (handle.step_count - 1 - WARMUP) % PERIOD == 0:  # a round just ran
                full = F.full_params(model)
                both = [torch.empty_like(full) for _ in range(world_size)]
                dist.all_gather(both, full)
                gaps.append(float((both[0] - both[2]).abs().max()))  # the two replicas
    handle.remove()
    return {"gaps": gaps, "warned": sum("end of the warm-up" in str(w.message) for w in caught)}


def test_replicas_apart_after_an_fsdp2_warm_up_meet_at_the_first_round():
    for out in run_ranks(_rank_warmup_without_grad_hooks, 4, timeout_s=120):
        assert out["warned"] == 1 and out["gaps"] == [0.0, 0.0]


def _rank_init_apart(rank, world_size):
    """FSDP2 replica groups built from different seeds (FSDP2 broadcasts nothing across
    them), int8 rounds from registration on."""
    import warnings

    import torch.distributed as dist

    model, replicate = F.sharded_model(2, seed=rank // 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = dah.register_averaging_hook(model, h.int8_compress_hook,
                                             h.QuantizedDeltaState(process_group=replicate),
                                             period=PERIOD, optimizer=opt)
    gaps = []
    for step in range(2 * PERIOD):
        F.train_step(model, opt, rank, step)
        if (handle.step_count - 1) % PERIOD == 0:  # a round just ran
            full = F.full_params(model)
            both = [torch.empty_like(full) for _ in range(world_size)]
            dist.all_gather(both, full)
            gaps.append(float((both[0] - both[2]).abs().max()))
    handle.remove()
    return {"gaps": gaps, "warned": sum("at registration" in str(w.message) for w in caught)}


def test_fsdp2_replicas_built_apart_meet_at_the_first_round_with_a_warning():
    for out in run_ranks(_rank_init_apart, 4, timeout_s=120):
        assert out["warned"] == 1 and out["gaps"] == [0.0, 0.0]


def _rank_consensus(rank, world_size):
    """``track_consensus`` on shards against the distance computed here from the full
    parameters of both replicas just before each round; with the test model and with one
    whose shards on shard rank 1 are all empty."""
    import torch.distributed as dist

    from _helpers import batch

    out = {}
    for dims in (F.DIMS, (5, 1, 1)):  # (5, 1, 1): one row per layer, none on shard rank 1
        model, replicate = F.sharded_model(2, dims=dims)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        handle = dah.register_averaging_hook(model, h.allreduce_hook, replicate, period=2,
                                             track_consensus=True)
        got, want = [], []
        for step in range(5):
            x, y = batch(rank, step, dims=dims)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if handle.is_averaging_step():
                full = F.full_params(model).double()
                every = [torch.empty_like(full) for _ in range(world_size)]
                dist.all_gather(every, full)
                replicas = (every[0], every[2])  # ranks 0-1 and 2-3 are the replica groups
                mean = (replicas[0] + replicas[1]) / 2
                want.append(sum(float((r - mean).pow(2).sum()) for r in replicas) / 2)
                handle.step()
                got.append(handle.stats.consensus_distance)
            else:
                handle.step()
        handle.remove()
        out[dims] = (got, want)
    return out


def test_consensus_distance_covers_the_whole_model_on_every_rank():
    for out in run_ranks(_rank_consensus, 4, timeout_s=120):
        for dims, (got, want) in out.items():
            assert len(got) == len(want) >= 2 and min(want) > 0, (dims, got, want)
            assert got == pytest.approx(want, rel=1e-9), (dims, got, want)
