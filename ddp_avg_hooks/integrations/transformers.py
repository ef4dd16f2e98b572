"""Transformers: :func:`add_local_sgd` puts local SGD into a Hugging Face ``Trainer``.

Callback events receive the unwrapped model, so the callback holds the trainer and reads
``trainer.model_wrapped``, the ``DistributedDataParallel`` model, at ``on_train_begin``.

Checkpoints: the ``Trainer`` saves rank 0's model and optimizer only, but after the warm-up
every replica has its own parameters and momentum until the next round. So at every
``on_save`` each rank writes ``ddp_avg_hooks_rank{r}.pt`` into the checkpoint folder
(``checkpoint-{global_step}``): its model, optimizer and handle state. When
``trainer.train(resume_from_checkpoint=...)`` resumes, each rank loads its own file at
``on_train_begin`` (after the ``Trainer`` loaded rank 0's), so the run continues exactly
as an uninterrupted one would: the counter, the rounds, the stats, every replica.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from transformers import TrainerCallback

from .. import hooks
from ..registry import register_averaging_hook
from ._common import (SHARDED_REFUSAL, GradSync, check_rank_state, detach, find_ddp,
                      load_rank_state, rank_state)

STATE_FILE = "ddp_avg_hooks_rank{rank}.pt"


class LocalSGDCallback(TrainerCallback):
    """Average the replicas every ``period`` optimizer steps of ``trainer``.

    Registers at ``on_train_begin``, steps the handle at every ``on_step_end`` (once per
    optimizer step, after ``gradient_accumulation_steps`` micro-batches), and at
    ``on_train_end`` averages once more (with ``average_at_end``) and removes the hook.
    Every rank's state goes into every Trainer checkpoint and comes back on resume (see
    the module). With a single process it does nothing. Use :func:`add_local_sgd` to make
    one.
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
        if ddp is None and getattr(self.trainer, "is_fsdp_enabled", False):
            raise RuntimeError("add_local_sgd: the Trainer's FSDP is not supported: "
                               + SHARDED_REFUSAL.format(what="it"))
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
        if state.global_step > 0:  # resumed: the Trainer loaded rank 0's model and optimizer
            self._resume(args, state)

    def _state_path(self, folder: str) -> str:
        return os.path.join(folder, STATE_FILE.format(rank=self.trainer.args.process_index))

    def _resume(self, args, state) -> None:
        folders = [args.resume_from_checkpoint] if isinstance(args.resume_from_checkpoint, str) \
            else []
        folders.append(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        path = next((self._state_path(f) for f in folders if os.path.isfile(self._state_path(f))),
                    None)
        if path is None:
            raise RuntimeError(
                f"add_local_sgd: the Trainer resumed at step {state.global_step} but no "
                f"averaging state was found ({', '.join(self._state_path(f) for f in folders)}); "
                "without it every rank would restart from rank 0's model and the warm-up. "
                "Resume from a checkpoint saved with this callback")
        saved = torch.load(path, weights_only=True)
        check_rank_state(saved, f"add_local_sgd ({path})")
        load_rank_state(saved, self.trainer.model, [self.trainer.optimizer], self.handle)

    def on_save(self, args, state, control, **kwargs):
        if self.handle is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)  # another node's rank 0 made it on its own disk
        saved = rank_state(self.trainer.model, [self.trainer.optimizer], self.handle.state_dict())
        tmp = self._state_path(folder) + ".tmp"
        torch.save(saved, tmp)
        os.replace(tmp, self._state_path(folder))

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
        hook, state, period, warmup_steps: as for
            :func:`~ddp_avg_hooks.register_averaging_hook`.
        **options: the other options of :func:`~ddp_avg_hooks.register_averaging_hook`,
            plus ``grad_sync_after_warmup`` and ``average_at_end`` (see
            :class:`LocalSGDCallback`).

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
