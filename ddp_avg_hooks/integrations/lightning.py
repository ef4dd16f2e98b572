"""Lightning: :class:`AveragingCallback` runs local SGD under ``Trainer(strategy="ddp")``.

The callback registers the hook on the ``DDPStrategy``'s ``DistributedDataParallel``
model at ``on_fit_start``, with the trainer's optimizer, so the handle steps after every
optimizer step (after the accumulated micro-batches, with ``accumulate_grad_batches``).

Checkpoints: Lightning saves rank 0's model and optimizer only, but after the warm-up
every replica has its own parameters and momentum until the next round. So the
callback's entry in a checkpoint holds every rank's model, optimizers and handle state,
and on ``fit(ckpt_path=...)`` each rank puts its own back at ``on_train_start``, after
Lightning restored rank 0's: every replica goes on from exactly its own state at that step.
The run as a whole goes on bit for bit where Lightning resumes the data so too: from a
checkpoint at an epoch's end, or with a resumable (stateful) data loader; from the middle
of an epoch Lightning restarts a plain loader's epoch (and warns). A checkpoint without
this callback's state is refused, since every rank would restart from rank 0's model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy

from .. import hooks
from ..registry import register_averaging_hook
from ._common import (SHARDED_REFUSAL, GradSync, check_arguments, check_rank_state, detach,
                      find_ddp, load_rank_state, rank_state)


class AveragingCallback(Callback):
    """Average the DDP replicas' parameters every ``period`` optimizer steps.

    Args:
        hook, state, period, warmup_steps: as for
            :func:`~ddp_avg_hooks.register_averaging_hook` (``optimizer=`` is the
            trainer's).
        **options: the other options of :func:`~ddp_avg_hooks.register_averaging_hook`.
        optimizer_index: with several optimizers (manual optimization), the one whose
            steps are the schedule's steps; with one, that one (the default).
        grad_sync_after_warmup: keep DDP's gradient all-reduce after the warm-up too
            (default ``False``: ``local_sgd_grad_hook`` keeps gradients local then).
        average_at_end: average once more at ``on_fit_end``, so every rank ends ``fit``
            with the same model (default ``True``).

    ``handle`` is the :class:`~ddp_avg_hooks.AveragingHandle` during ``fit``; ``stats``
    its :class:`~ddp_avg_hooks.AveragingStats` (kept after ``fit``).
    ``state_dict()`` gathers every rank's model, optimizers and handle state
    (collective: Lightning calls it on every rank when it saves, and rank 0 writes the
    file: the checkpoint holds one copy of the model per rank); on load each rank takes
    its own entry, applied at ``on_train_start`` (see the module).

    Example::

        callback = AveragingCallback(dah.hooks.allreduce_hook, period=8, warmup_steps=100)
        trainer = lightning.Trainer(strategy="ddp", callbacks=[callback], ...)
    """

    def __init__(self, hook: Callable = hooks.allreduce_hook, state=None, *, period,
                 warmup_steps: int = 0, grad_sync_after_warmup: bool = False,
                 average_at_end: bool = True, optimizer_index: int | None = None,
                 **options) -> None:
        if "optimizer" in options:
            raise TypeError("AveragingCallback: optimizer= is not an option here; the "
                            "trainer's optimizer is used")
        check_arguments("AveragingCallback", hook, state,
                        {"grad_sync_after_warmup": grad_sync_after_warmup,
                         "average_at_end": average_at_end},
                        trainer_optimizer=True, period=period, warmup_steps=warmup_steps,
                        **options)
        self.hook, self.state = hook, state
        self.period, self.warmup_steps = period, warmup_steps
        self.grad_sync_after_warmup, self.average_at_end = grad_sync_after_warmup, average_at_end
        self.options = options
        self.optimizer_index = optimizer_index
        self.handle = None
        self.stats = None
        self._ddp = None
        self._trainer = self._module = None
        self._loaded: dict | None = None  # a checkpoint's entry, waiting for the handle
        self._restored = False  # whether this fit put a checkpoint's entry back
        self._last: dict | None = None    # this rank's state when fit ended

    # --- fit ----------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        ddp = find_ddp(getattr(strategy, "model", None))
        if not isinstance(strategy, DDPStrategy) or ddp is None:
            name = type(strategy).__name__
            if name in ("ModelParallelStrategy", "FSDPStrategy"):
                raise RuntimeError("AveragingCallback: Lightning's " + name + " is not "
                                   "supported: " + SHARDED_REFUSAL.format(what="it"))
            raise RuntimeError(
                "AveragingCallback needs Lightning's DDP strategy, which wraps the model in "
                f"DistributedDataParallel; this trainer's strategy is {name}. "
                'Use Trainer(strategy="ddp", ...) (or strategy=DDPStrategy(...)); '
                "DeepSpeed and single-device strategies are not supported"
            )
        n = len(trainer.optimizers)
        index = self.optimizer_index
        if index is None and n != 1:
            raise ValueError(
                f"AveragingCallback: the trainer has {n} optimizers; pass "
                "AveragingCallback(..., optimizer_index=i), the optimizer whose steps count "
                "as the averaging schedule's steps (each of its steps is one step)")
        index = 0 if index is None else index
        if not 0 <= index < n:
            raise ValueError(f"AveragingCallback: optimizer_index={index}, but the trainer "
                             f"has {n} optimizers")
        self._ddp, self._trainer, self._module = ddp, trainer, pl_module
        self._restored = False
        self.handle = register_averaging_hook(
            ddp, self.hook, self.state, period=self.period, warmup_steps=self.warmup_steps,
            optimizer=trainer.optimizers[index], **self.options)
        self.stats = self.handle.stats
        if not self.grad_sync_after_warmup:
            GradSync.attach(ddp, self.handle)

    def on_train_start(self, trainer, pl_module) -> None:
        # after Lightning restored rank 0's model and optimizers: each rank's own
        if self.handle is None:
            return
        if self._loaded is not None:
            self._apply(self._loaded, trainer.global_rank)
            self._loaded = None
        elif trainer.ckpt_path is not None and trainer.global_step > 0 and not self._restored:
            raise RuntimeError(
                f"AveragingCallback: fit(ckpt_path={trainer.ckpt_path!r}) resumed at step "
                f"{trainer.global_step} from a checkpoint without this callback's state "
                "(saved without AveragingCallback): every rank would restart from rank 0's "
                "model and momentum, and the schedule from step 0. Resume from a checkpoint "
                "saved with AveragingCallback, or fit without ckpt_path")

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.handle is not None and self.average_at_end:
            self.handle.average()
        self._finish(keep_state=True)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._finish(keep_state=False)

    def _finish(self, *, keep_state: bool) -> None:
        if self.handle is None:
            return
        if keep_state:
            self._last = self._rank_state()
        self.handle.remove()
        self.handle = None
        detach(self._ddp)
        self._ddp = None

    # --- checkpoints --------------------------------------------------------------
    def _rank_state(self) -> dict:
        return rank_state(self._module, self._trainer.optimizers, self.handle.state_dict())

    def state_dict(self) -> dict:
        """Every rank's model, optimizers and handle state, ``{"world_size": n, "ranks":
        [...]}`` (collective), or ``{}`` before the first ``fit``."""
        mine = self._rank_state() if self.handle is not None else self._last
        if mine is None:
            return {}
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return {"world_size": 1, "ranks": [mine]}
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        return {"world_size": len(ranks), "ranks": ranks}

    def load_state_dict(self, state_dict: dict) -> None:
        if self.handle is None:
            self._loaded = state_dict
        else:
            self._apply(state_dict, dist.get_rank() if dist.is_initialized() else 0)

    def _apply(self, state_dict: dict, rank: int) -> None:
        world = dist.get_world_size() if dist.is_initialized() else 1
        if state_dict["world_size"] != world:
            raise ValueError(
                f"AveragingCallback: the checkpoint holds the averaging state of "
                f"{state_dict['world_size']} ranks, this run has {world}; resume with the "
                "same number of processes"
            )
        mine = state_dict["ranks"][rank]
        check_rank_state(mine, "AveragingCallback")
        load_rank_state(mine, self._module, self._trainer.optimizers, self.handle)
        self._restored = True
