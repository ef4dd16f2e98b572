"""``torch.compile`` both ways round a DDP model: same results as eager, no recompiles."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _helpers import flat, make_model


def _train(mode: str, hook, steps: int = 6, sync_flags: list | None = None) -> torch.Tensor:
    """``sync_flags``: with a list, gradients are averaged by ``local_sgd_grad_hook`` for
    a 2-step warm-up, and the list gets DDP's ``require_backward_grad_sync`` after each
    step."""
    model = make_model()
    if mode == "compile_then_ddp":
        ddp = runner = DDP(torch.compile(model, backend="aot_eager"))
        registered = ddp
    else:
        ddp = DDP(model)
        runner = torch.compile(ddp, backend="aot_eager") if mode == "ddp_then_compile" else ddp
        registered = runner  # a compiled DDP is unwrapped by the registry
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    warmup = 0 if sync_flags is None else 2
    handle = dah.register_averaging_hook(registered, hook, None, period=2, optimizer=opt,
                                         warmup_steps=warmup)
    if sync_flags is not None:
        ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 5, generator=g)
        # the first step compiles; later ones, with parameters written back in place by
        # the rounds (after steps 0, 2, 4), must reuse the graph
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            opt.zero_grad()
            runner(x).pow(2).sum().backward()
            opt.step()
        if sync_flags is not None:
            sync_flags.append(ddp.require_backward_grad_sync)
    assert handle.stats.rounds == (3 if sync_flags is None else 2)
    handle.remove()
    return flat(model)


@pytest.mark.parametrize("mode", ["ddp_then_compile", "compile_then_ddp"])
@pytest.mark.parametrize("hook", [dah.hooks.allreduce_hook, dah.hooks.fp16_compress_hook])
def test_compiled_models_average_like_eager_without_recompiles(world1, mode, hook):
    torch._dynamo.reset()
    expected = _train("eager", hook)
    got = _train(mode, hook)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("mode", ["ddp_then_compile", "compile_then_ddp"])
def test_compiled_models_skip_the_reducer_after_the_warmup_without_recompiles(world1, mode):
    torch._dynamo.reset()
    eager_flags, flags = [], []
    expected = _train("eager", dah.hooks.allreduce_hook, sync_flags=eager_flags)
    got = _train(mode, dah.hooks.allreduce_hook, sync_flags=flags)
    assert torch.equal(got, expected)
    # the reducer runs in the 2 warm-up steps and is off from the first local backward on
    assert flags == eager_flags == [True, True, False, False, False, False]


def test_compiled_non_ddp_model_is_a_clear_error(world1):
    with pytest.raises(TypeError, match=r"torch.compile of a Sequential.*DistributedDataParallel"):
        dah.register_averaging_hook(torch.compile(make_model()), dah.hooks.allreduce_hook, None)
