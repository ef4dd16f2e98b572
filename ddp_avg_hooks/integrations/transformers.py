"""Transformers: :func:`add_local_sgd` puts local SGD into a Hugging Face ``Trainer``.

Callback events receive the unwrapped model, so the callback holds the trainer and reads
``trainer.model_wrapped``, the ``DistributedDataParallel`` model, at ``on_train_begin``.

Checkpoints: the ``Trainer`` saves rank 0's model and optimizer only, but after the warm-up
every replica has its own parameters and momentum until the next round. So at every
``on_save`` each rank writes ``ddp_avg_hooks_rank{r}.pt`` into the checkpoint folder
(``checkpoint-{global_step}``): its model, optimizer and handle state. When
``trainer.train(resume_from_checkpoint=...)`` resumes, each rank loads its own file from
that folder at ``on_train_begin`` (after the ``Trainer`` loaded rank 0's), so the run
continues exactly as an uninterrupted one would: the counter, the rounds, the stats, every
replica. The ``Trainer`` does not tell its callbacks which folder it resumes from, so the
callback wraps ``trainer.train`` to note it; rank 0 checks that its file holds the model the
``Trainer`` loaded, so the state of another run or step is refused on every rank.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from .. import hooks
from ..registry import register_averaging_hook
from ._common import (SHARDED_REFUSAL, GradSync, check_arguments, detach, find_ddp,
                      load_rank_state, read_rank_state, refuse_together, write_rank_state)

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
        if not callable(getattr(trainer, "train", None)):
            raise TypeError("LocalSGDCallback: trainer must be a transformers.Trainer, got "
                            f"{type(trainer).__name__}")
        check_arguments("LocalSGDCallback", hook, state,
                        {"grad_sync_after_warmup": grad_sync_after_warmup,
                         "average_at_end": average_at_end},
                        trainer_optimizer=True, period=period, warmup_steps=warmup_steps,
                        **options)
        self.trainer = trainer
        self.hook, self.state, self.period, self.warmup_steps = hook, state, period, warmup_steps
        self.grad_sync_after_warmup, self.average_at_end = grad_sync_after_warmup, average_at_end
        self.options = options
        self.handle = None
        self.stats = None
        self._ddp = None
        self._resume_from: str | bool | None = None
        self._note_resume_folder(trainer)

    def _note_resume_folder(self, trainer) -> None:
        """Wrap ``trainer.train`` to note its ``resume_from_checkpoint``: the folder each
        rank's averaging state comes back from."""
        train = trainer.train

        @functools.wraps(train)
        def train_noting_the_checkpoint(resume_from_checkpoint=None, *args, **kwargs):
            self._resume_from = resume_from_checkpoint
            return train(resume_from_checkpoint, *args, **kwargs)
        trainer.train = train_noting_the_checkpoint

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
            try:
                self._resume(args, state)
            except BaseException:
                self._finish()
                raise

    def _state_path(self, folder: str) -> str:
        return os.path.join(folder, STATE_FILE.format(rank=self.trainer.args.process_index))

    def _resume_folder(self, args, state) -> str:
        folder = self._resume_from
        if folder is True:
            folder = get_last_checkpoint(args.output_dir)
        if isinstance(folder, str):
            return folder
        # train() was called another way: the Trainer's own default
        if isinstance(args.resume_from_checkpoint, str):
            return args.resume_from_checkpoint
        return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")

    def _resume(self, args, state) -> None:
        folder = self._resume_folder(args, state)
        path = self._state_path(folder)
        saved, problem = read_rank_state(path)
        if problem is None and args.process_index == 0 and not _same_tensors(
                saved["model"], self.trainer.model.state_dict()):
            problem = (f"{path} holds another model than the one the Trainer loaded from "
                       f"{folder} (a file of another run or step)")
        refuse_together(
            problem, self._ddp.process_group,
            f"add_local_sgd: the Trainer resumed from {folder} at step {state.global_step}, "
            "but the averaging state there does not fit it",
            "Without each rank's own state every rank would restart from rank 0's model and "
            "the warm-up. Resume from a checkpoint folder saved with this callback, as the run "
            "left it")
        load_rank_state(saved, self.trainer.model, [self.trainer.optimizer], self.handle)

    def on_save(self, args, state, control, **kwargs):
        if self.handle is None:
            return
        # each node's rank 0 makes the folder on its own disk; the other ranks may be first
        write_rank_state(
            self._state_path(os.path.join(args.output_dir, f"checkpoint-{state.global_step}")),
            self.trainer.model, [self.trainer.optimizer], self.handle.state_dict())

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
            self._finish()

    def _finish(self) -> None:
        self.handle.remove()
        self.handle = None
        detach(self._ddp)


def _same_tensors(a: dict, b: dict) -> bool:
    """Whether two state dicts hold the same names and tensors (bit for bit)."""
    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.dtype == y.dtype and torch.equal(x.cpu(), y.detach().cpu())
        return type(x) is type(y)  # a module's extra state: not compared
    return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)


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
