"""Transformers: :func:`add_local_sgd` puts local SGD into a Hugging Face ``Trainer``.

Callback events receive the unwrapped model, so the callback holds the trainer and reads
``trainer.model_wrapped``, the ``DistributedDataParallel`` model, at ``on_train_begin``.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import TrainerCallback

from .. import hooks
from ..registry import register_averaging_hook
from ._common import GradSync, detach, find_ddp


class LocalSGDCallback(TrainerCallback):
    """Average the replicas every ``period`` optimizer steps of ``trainer``.

    Registers at ``on_train_begin``, steps the handle at every ``on_step_end`` (once per
    optimizer step, after ``gradient_accumulation_steps`` micro-batches), and at
    ``on_train_end`` averages once more (with ``average_at_end``) and removes the hook.
    With a single process it does nothing. Use :func:`add_local_sgd` to make one.
    """

    def __init__(self, trainer, hook: Callable = hooks.allreduce_hook, state=None, *, period,
                 warmup_steps: int = 0, grad_sync_after_warmup: bool = False,
                 average_at_end: bool = True, **options) -> None:
        self.trainer = trainer
        self.hook, self.state, self.period, self.warmup_steps = hook, state, period, warmup_steps
        self.grad_sync_after_warmup, self.average_at_end = grad_sync_after_warmup, average_at_end
        self.options = options
        self.handle = None
        self.stats = None
        self._ddp = None

    def on_train_begin(self, args, state, control, **kwargs):
        if args.world_size <= 1:
            return
        ddp = find_ddp(self.trainer.model_wrapped)
        if ddp is None:
            raise RuntimeError(
                "add_local_sgd: the Trainer did not wrap the model in DistributedDataParallel "
                f"(trainer.model_wrapped is a {type(self.trainer.model_wrapped).__name__}); "
                "launch the processes with torchrun or accelerate launch, without DeepSpeed or FSDP"
            )
        self._ddp = ddp
        self.handle = register_averaging_hook(ddp, self.hook, self.state, period=self.period,
                                              warmup_steps=self.warmup_steps, **self.options)
        self.stats = self.handle.stats
        if not self.grad_sync_after_warmup:
            GradSync.attach(ddp, self.handle)

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.step()

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is None:
            return
        try:
            if self.average_at_end:
                self.handle.average()
        finally:
            self.handle.remove()
            self.handle = None
            detach(self._ddp)


def add_local_sgd(trainer, hook: Callable = hooks.allreduce_hook, state=None, *, period,
                  warmup_steps: int = 0, **options) -> LocalSGDCallback:
    """Add a :class:`LocalSGDCallback` to ``trainer`` and return it.

    Args:
        trainer: a ``transformers.Trainer``.
        hook, state, period, warmup_steps, **options: as for
            :func:`~ddp_avg_hooks.register_averaging_hook`, plus ``grad_sync_after_warmup``
            and ``average_at_end`` (see :class:`LocalSGDCallback`).

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=train)
        local_sgd = add_local_sgd(trainer, dah.hooks.allreduce_hook, period=8, warmup_steps=50)
        trainer.train()
        print(local_sgd.stats.rounds)
    """
    callback = LocalSGDCallback(trainer, hook, state, period=period, warmup_steps=warmup_steps,
                                **options)
    trainer.add_callback(callback)
    return callback
