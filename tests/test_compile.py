"""``torch.compile`` both ways round a DDP model: same results as eager, no recompiles."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_avg_hooks as dah
from _helpers import flat, make_model


def _train(mode: str, hook, steps: int = 6) -> torch.Tensor:
    model = make_model()
    if mode == "compile_then_ddp":
        ddp = runner = DDP(torch.compile(model, backend="aot_eager"))
        registered = ddp
    else:
        ddp = DDP(model)
        runner = torch.compile(ddp, backend="aot_eager") if mode == "ddp_then_compile" else ddp
        registered = runner  # a compiled DDP is unwrapped by the registry
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    handle = dah.register_averaging_hook(registered, hook, None, period=2, optimizer=opt)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x = torch.randn(4, 5, generator=g)
        # the first step compiles; later ones, with parameters written back in place by
        # the rounds (after steps 0, 2, 4), must reuse the graph
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            opt.zero_grad()
            runner(x).pow(2).sum().backward()
            opt.step()
    assert handle.stats.rounds == 3
    handle.remove()
    return flat(model)


@pytest.mark.parametrize("mode", ["ddp_then_compile", "compile_then_ddp"])
@pytest.mark.parametrize("hook", [dah.hooks.allreduce_hook, dah.hooks.fp16_compress_hook])
def test_compiled_models_average_like_eager_without_recompiles(world1, mode, hook):
    torch._dynamo.reset()
    expected = _train("eager", hook)
    got = _train(mode, hook)
    assert torch.equal(got, expected)


def test_compiled_non_ddp_model_is_a_clear_error(world1):
    with pytest.raises(TypeError, match=r"torch.compile of a Sequential.*DistributedDataParallel"):
        dah.register_averaging_hook(torch.compile(make_model()), dah.hooks.allreduce_hook, None)
