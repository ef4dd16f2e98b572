"""Accelerate: :class:`LocalSGD`, shaped like ``accelerate.local_sgd.LocalSGD``.

Same arguments, same use (``with LocalSGD(...) as local_sgd:`` around the loop,
``local_sgd.step()`` after each optimizer step, one average on leaving), but the
parameters are averaged by this library's hooks and the gradients are kept local by
``local_sgd_grad_hook`` instead of ``model.no_sync()``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from accelerate import Accelerator, DistributedType

from .. import hooks
from ..registry import register_averaging_hook
from ._common import GradSync, detach, find_ddp

_UNSUPPORTED = {getattr(DistributedType, name)
                for name in ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA", "TPU")
                if hasattr(DistributedType, name)}


class LocalSGD:
    """Local SGD on an ``Accelerator``-prepared model, averaged every ``local_sgd_steps`` steps.

    Args:
        accelerator: the ``Accelerator``.
        model: the model ``accelerator.prepare`` returned (a ``DistributedDataParallel``
            with several processes).
        local_sgd_steps: the period, in optimizer steps.
        enabled: ``False`` makes everything a no-op (as it is with a single process).
        hook, state, warmup_steps, **options: as for
            :func:`~ddp_avg_hooks.register_averaging_hook`. During the ``warmup_steps``
            first steps gradients are averaged as usual; after them they stay local.

    The schedule is this library's (PyTorch's ``PeriodicModelAverager``'s): rounds after
    optimizer steps ``warmup_steps + 1``, ``warmup_steps + 1 + local_sgd_steps``, ...;
    accelerate's own class averages after steps ``local_sgd_steps``,
    ``2 * local_sgd_steps``, ... . ``step()`` counts an optimizer step only when
    ``accelerator.sync_gradients`` is true, so inside ``accelerator.accumulate(model)``
    the accumulated micro-batches make one step. On leaving the block the replicas
    average once more (unless an exception is leaving it) and gradients are averaged
    every step again.

    ``handle`` is the :class:`~ddp_avg_hooks.AveragingHandle` inside the block.
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, local_sgd_steps: int,
                 enabled: bool = True, *, hook: Callable = hooks.allreduce_hook, state=None,
                 warmup_steps: int = 0, **options) -> None:
        if accelerator.distributed_type in _UNSUPPORTED:
            raise NotImplementedError(
                "LocalSGD is supported only for multi-CPU/GPU DistributedDataParallel, not "
                f"{accelerator.distributed_type}"
            )
        self.enabled = enabled and accelerator.num_processes > 1
        self.num_steps = 0
        self.accelerator, self.model, self.local_sgd_steps = accelerator, model, local_sgd_steps
        self.hook, self.state, self.warmup_steps, self.options = hook, state, warmup_steps, options
        self.handle = None
        self._ddp = find_ddp(model) if self.enabled else None
        if self.enabled and self._ddp is None:
            raise TypeError(
                "LocalSGD: model must be the DistributedDataParallel model that "
                f"accelerator.prepare(model) returns, got {type(model).__name__}"
            )

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self.handle = register_averaging_hook(
                self._ddp, self.hook, self.state, period=self.local_sgd_steps,
                warmup_steps=self.warmup_steps, **self.options)
            GradSync.attach(self._ddp, self.handle)
        return self

    def __exit__(self, type, value, tb) -> None:
        if self.handle is None:
            return
        try:
            if type is None:
                self.handle.average()  # every replica leaves with the same model
        finally:
            self.handle.remove()
            self.handle = None
            detach(self._ddp)

    def step(self) -> None:
        """Call after each ``optimizer.step()``: averages when the schedule says so."""
        self.num_steps += 1
        if self.handle is not None and self.accelerator.sync_gradients:
            self.handle.step()
