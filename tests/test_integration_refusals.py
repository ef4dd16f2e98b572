"""The frameworks' sharded training is refused by the integrations, saying why and what to
do instead (the 1-D shard mesh recipe with register_averaging_hook)."""

from __future__ import annotations

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
