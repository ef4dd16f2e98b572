"""Running :meth:`AveragingHandle.step <ddp_avg_hooks.AveragingHandle.step>` after each
``optimizer.step()`` (``optimizer=``)."""

from __future__ import annotations

import torch


def _is_state_init_step(optimizer: torch.optim.Optimizer) -> bool:
    """The step ``torch.distributed.checkpoint`` takes to create an optimizer's state: no
    state yet, every learning rate 0, every gradient all zeros. Not a training step."""
    if optimizer.state:
        return False
    groups = optimizer.param_groups
    if not all(float(g.get("lr", 1.0)) == 0.0 for g in groups):
        return False
    grads = [p.grad for g in groups for p in g["params"] if p.requires_grad]
    return all(grad is not None and not bool(grad.any()) for grad in grads)


class StepHooks:
    """``step()`` after each ``optimizer.step()``, except a state-creating one (above)."""

    def __init__(self, optimizer: torch.optim.Optimizer, step) -> None:
        self._skip = False
        self._pre = optimizer.register_step_pre_hook(self._before)
        self._post = optimizer.register_step_post_hook(lambda *_: None if self._skip else step())

    def _before(self, optimizer, *_) -> None:
        self._skip = _is_state_init_step(optimizer)

    def remove(self) -> None:
        self._pre.remove()
        self._post.remove()
