"""Accelerate: :class:`LocalSGD`, shaped like ``accelerate.local_sgd.LocalSGD``.

Same arguments, same use (``with LocalSGD(...) as local_sgd:`` around the loop,
``local_sgd.step()`` after each optimizer step, one average on leaving), but the
parameters are averaged by this library's hooks and the gradients are kept local by
``local_sgd_grad_hook`` instead of ``model.no_sync()``.

Each ``with`` block runs its own schedule, as accelerate's class does: a block (one per
epoch, say) starts with its warm-up, then rounds every ``local_sgd_steps`` steps.

Checkpoints: ``accelerator.save_state`` stores rank 0's model and optimizer only, but after
the warm-up every replica has its own parameters and momentum until the next round. So the
``LocalSGD`` objects of one model register with the accelerator once, and the newest
serves: ``save_state`` also writes ``ddp_avg_hooks_rank{r}.pt`` on every rank (its model,
the ``optimizer=`` given, and inside a block the handle's state), and ``load_state`` puts
each rank's back after Accelerate loaded rank 0's (the handle's when the ``with`` block
begins, if it has not begun yet; a state saved between blocks has none, and the next block
starts its own schedule, as it would have). Make a ``LocalSGD`` before
``accelerator.load_state``, as the accelerator's own objects. A folder without every
rank's file is refused on every rank before anything loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from accelerate import Accelerator, DistributedType

from .. import hooks
from ..registry import register_averaging_hook
from .._checks import check_int
from ._common import (SHARDED_REFUSAL, GradSync, check_arguments, detach, find_ddp,
                      load_rank_state, read_rank_state, refuse_together, world_size,
                      write_rank_state)

STATE_FILE = "ddp_avg_hooks_rank{rank}.pt"
#: the file of the second, third, ... model with LocalSGD blocks on one accelerator
MODEL_STATE_FILE = "ddp_avg_hooks_model{index}_rank{rank}.pt"

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

    The schedule is this library's (PyTorch's ``PeriodicModelAverager``'s), in each
    ``with`` block: rounds after its optimizer steps ``warmup_steps + 1``,
    ``warmup_steps + 1 + local_sgd_steps``, ...;
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
        if not hasattr(accelerator, "distributed_type"):
            raise TypeError(f"LocalSGD: accelerator must be an accelerate.Accelerator, got "
                            f"{type(accelerator).__name__}; call LocalSGD(accelerator, model, "
                            "local_sgd_steps)")
        check_int("local_sgd_steps", local_sgd_steps, 1, owner="LocalSGD")
        check_arguments("LocalSGD", hook, state, {"enabled": enabled},
                        trainer_optimizer=False, period=local_sgd_steps,
                        warmup_steps=warmup_steps, **options)
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
        self._checkpoints = _Checkpoints.serve(self) if self.enabled else None

    # --- checkpoints (see the module) ----------------------------------------------
    def _optimizers(self) -> list:
        return [] if self.optimizer is None else [self.optimizer]

    def _save(self, path: str) -> None:
        write_rank_state(path, self._ddp.module, self._optimizers(),
                         None if self.handle is None else self.handle.state_dict())

    def _load(self, saved: dict) -> None:
        if saved["averaging"] is None:  # saved between blocks: no schedule to go on with
            load_rank_state(saved, self._ddp.module, self._optimizers(), None)
        elif self.handle is None:
            # saved inside a block: all of it once a block begins, in whichever LocalSGD
            # of this model (one made per epoch, say, after the one that loaded it)
            self._checkpoints.pending = saved
        else:
            load_rank_state(saved, self._ddp.module, self._optimizers(), self.handle)

    def __enter__(self) -> "LocalSGD":
        if self.enabled:
            self.handle = register_averaging_hook(
                self._ddp, self.hook, self.state, period=self.local_sgd_steps,
                warmup_steps=self.warmup_steps, **self.options)
            GradSync.attach(self._ddp, self.handle)
            pending, self._checkpoints.pending = self._checkpoints.pending, None
            if pending is not None:
                load_rank_state(pending, self._ddp.module, self._optimizers(), self.handle)
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


class _Checkpoints:
    """The one registration of a model's ``LocalSGD`` objects with an accelerator's
    ``save_state`` / ``load_state``, serving the newest of them.

    Accelerate keeps every object registered for checkpointing for good, and
    ``load_state`` expects as many as the saving run had; a ``LocalSGD`` made per epoch
    would add one an epoch. So the objects of one model share one registration, whose
    index among the accelerator's models with ``LocalSGD`` names its files.
    """

    def __init__(self, accelerator: Accelerator, ddp, index: int) -> None:
        self.accelerator, self.ddp, self.index = accelerator, ddp, index
        self.local_sgd: LocalSGD | None = None
        self.loaded: dict | None = None  # this rank's file, read before Accelerate loads
        self.pending: dict | None = None  # a state saved inside a block, for the next block
        accelerator.register_save_state_pre_hook(self.save_hook)
        accelerator.register_load_state_pre_hook(self.load_hook)
        accelerator.register_for_checkpointing(self)

    @classmethod
    def serve(cls, local_sgd: LocalSGD) -> "_Checkpoints":
        """The registration of ``local_sgd``'s model (made the first time), now serving it."""
        accelerator = local_sgd.accelerator
        known = accelerator.__dict__.setdefault("_ddp_avg_hooks_checkpoints", [])
        mine = next((c for c in known if c.ddp is local_sgd._ddp), None)
        if mine is None:
            mine = cls(accelerator, local_sgd._ddp, len(known))
            known.append(mine)
        mine.local_sgd = local_sgd
        return mine

    def path(self, folder: str) -> str:
        rank = self.accelerator.process_index
        name = (STATE_FILE.format(rank=rank) if self.index == 0
                else MODEL_STATE_FILE.format(index=self.index, rank=rank))
        return os.path.join(folder, name)

    def save_hook(self, models, weights, output_dir) -> None:
        self.local_sgd._save(self.path(output_dir))

    def load_hook(self, models, input_dir) -> None:
        """Before Accelerate loads anything: every rank has its file, or every rank raises."""
        self.loaded, problem = read_rank_state(self.path(input_dir))
        refuse_together(
            problem, self.ddp.process_group,
            f"LocalSGD: accelerator.load_state({input_dir!r}) has no averaging state that fits "
            "this run",
            "Without each rank's own state every rank would restart from rank 0's model and "
            "momentum. Load a state saved by accelerator.save_state with a LocalSGD of this "
            "model made before it")

    def state_dict(self) -> dict:
        """What Accelerate saves for this object (rank 0's): the world size; each rank's
        own state is in its own file."""
        return {"world_size": world_size()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Called by ``accelerator.load_state`` on every rank after it loaded the models and
        optimizers: this rank's own model, optimizer and handle state."""
        loaded, self.loaded = self.loaded, None
        self.local_sgd._load(loaded)
