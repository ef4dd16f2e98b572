"""``zero_copy=True``: parameters become views of the buckets' storage; results are
bit-identical to the copying rounds, on 2 gloo ranks and in one process."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _dist import run_ranks
from _helpers import flat, make_model, train_step

HOOKS = {
    "allreduce": lambda: (dah.hooks.allreduce_hook, None),
    "fp16": lambda: (dah.hooks.fp16_compress_hook, None),
    "powersgd": lambda: (dah.hooks.powersgd_hook,
                         dah.hooks.PowerSGDState(matrix_approximation_rank=2)),
}


def _train(rank, name, zero_copy, check_finite=False, steps=9):
    model = make_model()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    hook, state = HOOKS[name]()
    handle = dah.register_averaging_hook(ddp, hook, state, period=3, warmup_steps=1, optimizer=opt,
                                         zero_copy=zero_copy, check_finite=check_finite,
                                         bucket_cap_mb=200 / 2**20)  # two buckets
    ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    ptrs = [p.data_ptr() for p in params]
    for step in range(steps):
        train_step(ddp, opt, rank, step)
    assert [p.data_ptr() for p in params] == ptrs  # no new storage after registration
    assert list(model.parameters()) == params  # the same Parameter objects
    memory = handle.memory_bytes()
    handle.remove()
    return {"params": flat(model), "rounds": handle.stats.rounds, "memory": memory,
            "views": [p.untyped_storage().data_ptr() for p in params]}


def _rank_parity(rank, world_size):
    out = {}
    for name in HOOKS:
        out[name] = (_train(rank, name, False), _train(rank, name, True),
                     _train(rank, name, True, check_finite=True))
    return out


def test_zero_copy_rounds_equal_copying_rounds():
    results = run_ranks(_rank_parity, 2, timeout_s=120)
    for rank in results:
        for name, (copying, zero, checked) in rank.items():
            assert copying["rounds"] == zero["rounds"] == 3
            assert torch.equal(zero["params"], copying["params"]), name
            assert torch.equal(checked["params"], copying["params"]), name
            assert len(set(zero["views"])) == 2  # the parameters share their buckets' storage
    exact = results[0]["allreduce"][1]["memory"]
    assert exact["bucket_buffers"] == {} and exact["scratch"] == {}  # nothing the model's size


def test_zero_copy_excludes_overlap(world1):
    with pytest.raises(ValueError, match="drop overlap=True"):
        dah.register_averaging_hook(DDP(make_model()), dah.hooks.allreduce_hook, None,
                                    zero_copy=True, overlap=True)


def test_zero_copy_checkpoint_resumes_exactly(world1):
    def build():
        model = make_model()
        ddp = DDP(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook, None, period=2,
                                             optimizer=opt, zero_copy=True)
        return model, ddp, opt, handle

    model, ddp, opt, handle = build()
    for step in range(7):
        train_step(ddp, opt, 0, step)
    straight = flat(model)
    model, ddp, opt, handle = build()
    for step in range(3):
        train_step(ddp, opt, 0, step)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": opt.state_dict(), "avg": handle.state_dict()}
    handle.remove()
    model, ddp, opt, handle = build()
    with torch.no_grad():  # in place: the parameters stay views of the buckets' storage
        for name, value in saved["model"].items():
            model.state_dict()[name].copy_(value)
    opt.load_state_dict(saved["opt"])
    handle.load_state_dict(saved["avg"])
    for step in range(3, 7):
        train_step(ddp, opt, 0, step)
    assert torch.equal(flat(model), straight)


def test_zero_copy_rejected_round_changes_nothing(world1):
    # check_finite=True: buffer() is a copy, so a round whose result is rejected leaves
    # the parameters (the buckets' own storage) as they were; a hook that raises before
    # writing anything does the same without the check.
    def nan_hook(state, bucket):
        out = bucket.buffer().mul_(float("nan"))  # scribbles on what buffer() gave it
        return dah.collectives.completed(out)

    def raising_hook(state, bucket):
        raise RuntimeError("peer gone")

    for hook, options in ((nan_hook, {"check_finite": True}), (raising_hook, {})):
        model = make_model()
        handle = dah.register_averaging_hook(DDP(model), hook, None, zero_copy=True, **options)
        before = flat(model)
        with pytest.raises(dah.AveragingHookError):
            handle.average()
        assert torch.equal(flat(model), before)
        handle.remove()


def _rank_replaced(rank, world_size):
    model = make_model()
    params = list(model.parameters())
    handle = dah.register_averaging_hook(DDP(model), dah.hooks.allreduce_hook, None,
                                         zero_copy=True, bucket_cap_mb=200 / 2**20)
    n = sum(p.numel() for p in params)
    out = {}
    # vector_to_parameters: every .data becomes a view of this rank's vector
    torch.nn.utils.vector_to_parameters(torch.arange(n, dtype=torch.float32) * (rank + 1), params)
    handle.average()
    out["vector"] = flat(model)
    with torch.no_grad():
        params[0].data = torch.full_like(params[0], float(rank))  # one parameter
    handle.average()
    out["one"] = params[0].detach().clone()
    out["storages"] = len({p.untyped_storage().data_ptr() for p in params})
    model.double()  # a cast cannot live in the buckets' float32 storage
    try:
        handle.average()
        out["cast"] = None
    except Exception as exc:
        out["cast"] = f"{type(exc).__name__}: {exc}"
    out["cast_kept"] = params[0].dtype
    return out


def test_zero_copy_follows_parameters_whose_data_was_replaced():
    # a round averages what the model holds, against the mean of the ranks' values
    # computed here; a replacement of another dtype is refused on every rank
    for out in run_ranks(_rank_replaced, 2, timeout_s=60, pg_timeout_s=10):
        n = out["vector"].numel()
        assert torch.equal(out["vector"], torch.arange(n, dtype=torch.float32) * 1.5)
        assert torch.equal(out["one"], torch.full_like(out["one"], 0.5))
        assert out["storages"] == 2  # views of the two buckets' storage again
        assert out["cast"] is not None and "zero_copy" in out["cast"], out["cast"]
        assert "torch.float64" in out["cast"] and "register" in out["cast"], out["cast"]
        assert out["cast_kept"] == torch.float64  # nothing changed
