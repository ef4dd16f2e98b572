"""Accelerate: :class:`LocalSGD`, shaped like ``accelerate.local_sgd.LocalSGD``.

Same arguments, same use (``with LocalSGD(...) as local_sgd:`` around the loop,
``local_sgd.step()`` after each optimizer step, one average on leaving), but the
parameters are averaged by this library's hooks and the gradients are kept local by
``local_sgd_grad_hook`` instead of ``model.no_sync()``.

Checkpoints: ``accelerator.save_state`` stores rank 0's model and optimizer only, but after
the warm-up every replica has its own parameters and momentum until the next round. So
``LocalSGD`` registers with the accelerator: ``save_state`` also writes
``ddp_avg_hooks_rank{r}.pt`` on every rank (its model, the ``optimizer=`` given, and the
handle's state), and ``load_state`` puts each rank's back after Accelerate loaded rank
0's (the handle's when the ``with`` block begins, if it has not begun yet). Make the
``LocalSGD`` before ``accelerator.load_state``, as the accelerator's own objects.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from accelerate import Accelerator, DistributedType

from .. import hooks
from ..registry import register_averaging_hook
from ._common import (SHARDED_REFUSAL, GradSync, check_rank_state, detach, find_ddp,
                      load_rank_state, rank_state, world_size)

STATE_FILE = "ddp_avg_hooks_rank{rank}.pt"

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
        hook, state, warmup_steps: as for
            :func:`~ddp_avg_hooks.register_averaging_hook`. During the ``warmup_steps``
            first steps gradients are averaged as usual; after them they stay local.
        **options: the other options of :func:`~ddp_avg_hooks.register_averaging_hook`.
        optimizer: the prepared optimizer, whose state every rank saves with
            ``accelerator.save_state`` (see the module); it does not step the handle,
            ``step()`` does.

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
                 warmup_steps: int = 0, optimizer=None, **options) -> None:
        if accelerator.distributed_type == getattr(DistributedType, "FSDP", None):
            raise NotImplementedError(
                "LocalSGD: Accelerate's FSDP plugin is not supported: "
                + SHARDED_REFUSAL.format(what="it"))
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
        self.optimizer = optimizer
        self._ddp = find_ddp(model) if self.enabled else None
        if self.enabled and self._ddp is None:
            raise TypeError(
                "LocalSGD: model must be the DistributedDataParallel model that "
                f"accelerator.prepare(model) returns, got {type(model).__name__}"
            )
        self._last: dict | None = None  # the handle's state when the block ended
        self._load_dir: str | None = None
        self._pending: dict | None = None  # a loaded handle state, waiting for the block
        if self.enabled:
            accelerator.register_save_state_pre_hook(self._save_hook)
            accelerator.register_load_state_pre_hook(self._load_hook)
            accelerator.register_for_checkpointing(self)

    # --- checkpoints (see the module) ----------------------------------------------
    def _optimizers(self) -> list:
        return [] if self.optimizer is None else [self.optimizer]

    def _path(self, folder: str) -> str:
        return os.path.join(folder, STATE_FILE.format(rank=self.accelerator.process_index))

    def _save_hook(self, models, weights, output_dir) -> None:
        handle_state = self.handle.state_dict() if self.handle is not None else self._last
        if handle_state is None:  # no block has begun: nothing of ours to save
            return
        os.makedirs(output_dir, exist_ok=True)
        tmp = self._path(output_dir) + ".tmp"
        torch.save(rank_state(self._ddp.module, self._optimizers(), handle_state), tmp)
        os.replace(tmp, self._path(output_dir))

    def _load_hook(self, models, input_dir) -> None:
        self._load_dir = input_dir

    def state_dict(self) -> dict:
        """What Accelerate saves for this object (rank 0's): the world size; each rank's
        own state is in its ``ddp_avg_hooks_rank{r}.pt``."""
        return {"world_size": world_size()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Called by ``accelerator.load_state`` on every rank, after it loaded the models and
        optimizers: load this rank's model, optimizer and handle state."""
        path = self._path(self._load_dir)
        if not os.path.isfile(path):
            raise RuntimeError(
                f"LocalSGD: accelerator.load_state({self._load_dir!r}) has no averaging state "
                f"for this rank ({path}); without it every rank would restart from rank 0's "
                "model and the warm-up. Load a state saved inside a LocalSGD block")
        saved = torch.load(path, weights_only=True)
        check_rank_state(saved, f"LocalSGD ({path})")
        if self.handle is None:
            self._pending = saved  # the handle's part, once the block has begun
        else:
            load_rank_state(saved, self._ddp.module, self._optimizers(), self.handle)

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self.handle = register_averaging_hook(
                self._ddp, self.hook, self.state, period=self.local_sgd_steps,
                warmup_steps=self.warmup_steps, **self.options)
            GradSync.attach(self._ddp, self.handle)
            if self._pending is not None:
                pending, self._pending = self._pending, None
                load_rank_state(pending, self._ddp.module, self._optimizers(), self.handle)
        return self

    def __exit__(self, type, value, tb) -> None:
        if self.handle is None:
            return
        try:
            if type is None:
                self.handle.average()  # every replica leaves with the same model
                self._last = self.handle.state_dict()
        finally:
            self.handle.remove()
            self.handle = None
            detach(self._ddp)

    def step(self) -> None:
        """Call after each ``optimizer.step()``: averages when the schedule says so."""
        self.num_steps += 1
        if self.handle is not None and self.accelerator.sync_gradients:
            self.handle.step()
