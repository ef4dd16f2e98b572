"""The frameworks' sharded training is refused by the integrations, saying why and what to
do instead (the 1-D shard mesh recipe with register_averaging_hook); their arguments are
checked when they are made, not when training starts."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest


def test_lightning_sharded_strategies_are_refused_with_the_recipe():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ddp_avg_hooks.integrations.lightning import AveragingCallback

    trainer = SimpleNamespace(strategy=ModelParallelStrategy(), optimizers=[])
    with pytest.raises(RuntimeError, match="ModelParallelStrategy is not supported") as err:
        AveragingCallback(period=4).on_fit_start(trainer, None)
    assert "keep one copy of each shard" in str(err.value)
    assert "examples/fsdp2.py" in str(err.value)


def test_accelerates_fsdp_plugin_is_refused_with_the_recipe():
    pytest.importorskip("accelerate")
    from accelerate import DistributedType

    from ddp_avg_hooks.integrations.accelerate import LocalSGD

    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, num_processes=2)
    with pytest.raises(NotImplementedError, match="FSDP plugin is not supported") as err:
        LocalSGD(accelerator, None, local_sgd_steps=4)
    assert "1-D shard mesh per replica group" in str(err.value)


def _refusals():
    import ddp_avg_hooks as dah

    cases = []
    if importlib.util.find_spec("lightning"):
        from ddp_avg_hooks.integrations.lightning import AveragingCallback
        cases += [
            (lambda: AveragingCallback(period=0), ValueError,
             "AveragingCallback: period must be >= 1, got 0"),
            (lambda: AveragingCallback(period="8"), TypeError, "period must be an int"),
            (lambda: AveragingCallback("allreduce", period=8), TypeError,
             "hook must be an averaging hook function"),
            (lambda: AveragingCallback(period=8, perid=8), TypeError,
             r"AveragingCallback: unknown option\(s\) \['perid'\]"),
            (lambda: AveragingCallback(period=8, grad_sync_after_warmup="no"), TypeError,
             "grad_sync_after_warmup must be True or False"),
            (lambda: AveragingCallback(dah.hooks.powersgd_hook, None, period=8), TypeError,
             "state must be a PowerSGDState"),
        ]
    if importlib.util.find_spec("transformers"):
        from ddp_avg_hooks.integrations.transformers import LocalSGDCallback
        trainer = SimpleNamespace(train=lambda **kw: None)
        cases += [
            (lambda: LocalSGDCallback(None, period=4), TypeError,
             "trainer must be a transformers.Trainer, got NoneType"),
            (lambda: LocalSGDCallback(trainer, period=4, warmup_steps=-1), ValueError,
             "LocalSGDCallback: warmup_steps must be >= 0"),
        ]
    if importlib.util.find_spec("accelerate"):
        from ddp_avg_hooks.integrations.accelerate import LocalSGD
        cases += [
            (lambda: LocalSGD(None, None, 8), TypeError,
             "LocalSGD: accelerator must be an accelerate.Accelerator, got NoneType"),
            (lambda: LocalSGD(SimpleNamespace(distributed_type=None), None, 0), ValueError,
             "LocalSGD: local_sgd_steps must be >= 1, got 0"),
        ]
    if importlib.util.find_spec("torchft"):
        from ddp_avg_hooks.integrations.torchft import FaultTolerantAveraging
        cases.append((lambda: FaultTolerantAveraging(SimpleNamespace(), "a DDP model"),
                      TypeError, "handle must be the AveragingHandle"))
    return cases


def test_integration_arguments_are_checked_when_made():
    cases = _refusals()
    assert cases, "no framework installed"
    for make, exc, says in cases:
        with pytest.raises(exc, match=says):
            make()
