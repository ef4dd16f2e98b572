"""Lightning: :class:`AveragingCallback` runs local SGD under ``Trainer(strategy="ddp")``.

The callback registers the hook on the ``DDPStrategy``'s ``DistributedDataParallel``
model at ``on_fit_start``, with the trainer's optimizer, so the handle steps after every
optimizer step (after the accumulated micro-batches, with ``accumulate_grad_batches``).
The handle's state travels in Lightning checkpoints, one entry per rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist
from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy

from .. import hooks
from ..registry import register_averaging_hook
from ._common import GradSync, detach, find_ddp, to_cpu


class AveragingCallback(Callback):
    """Average the DDP replicas' parameters every ``period`` optimizer steps.

    Args:
        hook, state, period, warmup_steps, **options: as for
            :func:`~ddp_avg_hooks.register_averaging_hook` (``optimizer=`` is the
            trainer's; it must have exactly one).
        grad_sync_after_warmup: keep DDP's gradient all-reduce after the warm-up too
            (default ``False``: ``local_sgd_grad_hook`` keeps gradients local then).
        average_at_end: average once more at ``on_fit_end``, so every rank ends ``fit``
            with the same model (default ``True``).

    ``handle`` is the :class:`~ddp_avg_hooks.AveragingHandle` during ``fit``; ``stats``
    its :class:`~ddp_avg_hooks.AveragingStats` (kept after ``fit``).
    ``state_dict()`` gathers every rank's ``handle.state_dict()`` (collective: Lightning
    calls it on every rank when it saves, and rank 0 writes the file); on load each
    rank takes its own entry, applied at registration if the handle does not exist yet.

    Lightning saves rank 0's model and optimizer state only: a checkpoint written right
    after a round has the model every rank shares, and with momentum or Adam pass
    ``optimizer_state="average"`` so the optimizer state is shared at a round too.

    Example::

        callback = AveragingCallback(dah.hooks.allreduce_hook, period=8, warmup_steps=100)
        trainer = lightning.Trainer(strategy="ddp", callbacks=[callback], ...)
    """

    def __init__(self, hook: Callable = hooks.allreduce_hook, state=None, *, period,
                 warmup_steps: int = 0, grad_sync_after_warmup: bool = False,
                 average_at_end: bool = True, **options) -> None:
        if "optimizer" in options:
            raise TypeError("AveragingCallback: optimizer= is not an option here; the "
                            "trainer's optimizer is used")
        self.hook, self.state = hook, state
        self.period, self.warmup_steps = period, warmup_steps
        self.grad_sync_after_warmup, self.average_at_end = grad_sync_after_warmup, average_at_end
        self.options = options
        self.handle = None
        self.stats = None
        self._ddp = None
        self._loaded: dict | None = None  # a checkpoint's entry, waiting for the handle
        self._last: dict | None = None    # this rank's handle state when fit ended

    # --- fit ----------------------------------------------------------------------
    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        ddp = find_ddp(getattr(strategy, "model", None))
        if not isinstance(strategy, DDPStrategy) or ddp is None:
            raise RuntimeError(
                "AveragingCallback needs Lightning's DDP strategy, which wraps the model in "
                f"DistributedDataParallel; this trainer's strategy is {type(strategy).__name__}. "
                'Use Trainer(strategy="ddp", ...) (or strategy=DDPStrategy(...)); '
                "FSDP, DeepSpeed and single-device strategies are not supported"
            )
        if len(trainer.optimizers) != 1:
            raise ValueError("AveragingCallback needs exactly one optimizer, the trainer has "
                             f"{len(trainer.optimizers)}")
        self._ddp = ddp
        self.handle = register_averaging_hook(
            ddp, self.hook, self.state, period=self.period, warmup_steps=self.warmup_steps,
            optimizer=trainer.optimizers[0], **self.options)
        self.stats = self.handle.stats
        if self._loaded is not None:
            self._apply(self._loaded, trainer.global_rank)
            self._loaded = None
        if not self.grad_sync_after_warmup:
            GradSync.attach(ddp, self.handle)

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
            self._last = to_cpu(self.handle.state_dict())
        self.handle.remove()
        self.handle = None
        detach(self._ddp)
        self._ddp = None

    # --- checkpoints --------------------------------------------------------------
    def state_dict(self) -> dict:
        """Every rank's handle state, ``{"world_size": n, "ranks": [...]}`` (collective),
        or ``{}`` before the first ``fit``."""
        mine = to_cpu(self.handle.state_dict()) if self.handle is not None else self._last
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
        self.handle.load_state_dict(state_dict["ranks"][rank])
