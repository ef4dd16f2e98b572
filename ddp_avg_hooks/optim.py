"""``AveragingOptimizer``: model averaging as a ``torch.optim.Optimizer``.

Averaging in the shape of an optimizer, like PyTorch's ``PostLocalSGDOptimizer``: one
object that steps the local optimizer and then the averaging schedule, and whose
``state_dict()`` carries both, so the usual ``torch.save(opt.state_dict())`` checkpoint
resumes averaging too.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import torch

_AVERAGING_KEY = "averaging"


class AveragingOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that every ``step()`` is followed by ``handle.step()``.

    A real ``torch.optim.Optimizer``: ``param_groups``, ``state`` and ``defaults`` *are*
    the inner optimizer's (the same objects, so an LR scheduler over this wrapper
    changes the inner optimizer's learning rate), ``zero_grad`` and ``add_param_group``
    go to it, and step pre/post hooks registered on the wrapper run around the whole
    step (inner step, then averaging). Per call::

        loss = optimizer.step(closure)   # the local step (its own hooks run too)
        handle.step()                    # averages when the schedule says so
        return loss

    ``state_dict()`` is the inner optimizer's state dict plus one key, ``"averaging"``,
    holding ``handle.state_dict()`` (step counter, anchors, hook state): restoring it
    with ``load_state_dict()`` in a fresh process resumes both exactly. A state dict
    without that key (a plain optimizer's) loads with a warning and leaves the handle
    as it is.

    Args:
        optimizer: the local optimizer over the DDP model's parameters.
        handle: the :class:`~ddp_avg_hooks.AveragingHandle` of that model, registered
            **without** ``optimizer=``: a handle registered with ``optimizer=`` already
            steps after every ``optimizer.step()``, so wrapping it too would step the
            schedule twice per step (``ValueError``, here or at ``step()``).

    Notes:
        With ``torch.amp.GradScaler`` use the plain optimizer and call ``handle.step()``
        yourself (see :class:`~ddp_avg_hooks.AveragingHandle`): the scaler skips
        ``step()`` on ranks whose gradients overflowed, which would skip the handle
        there only. Parameters added with ``add_param_group`` are optimized but not
        averaged (buckets are built at registration). Global optimizer hooks
        (``register_optimizer_step_pre_hook``) run for both the wrapper and the inner
        optimizer.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
        >>> opt = dah.AveragingOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), handle)
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        >>> for _ in range(4):
        ...     opt.zero_grad(); ddp(torch.randn(3, 4)).sum().backward(); opt.step(); sched.step()
        >>> handle.step_count, handle.stats.rounds, opt.optimizer.param_groups[0]["lr"]
        (4, 2, 0.025)
        >>> sorted(opt.state_dict())
        ['averaging', 'param_groups', 'state']
        >>> handle.remove(); dist.destroy_process_group()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, handle) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "AveragingOptimizer: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        methods = ("step", "state_dict", "load_state_dict")
        if not all(callable(getattr(handle, m, None)) for m in methods):
            raise TypeError(
                "AveragingOptimizer: handle must be the AveragingHandle returned by "
                f"register_averaging_hook, got {type(handle).__name__}"
            )
        inner = optimizer
        while isinstance(inner, AveragingOptimizer):
            if inner.handle is handle:
                raise ValueError(
                    "AveragingOptimizer: this optimizer already wraps the same handle; "
                    "wrapping it again would step the schedule twice per step"
                )
            inner = inner.optimizer
        _check_not_attached(handle)
        if callable(getattr(handle, "check_optimizer", None)):
            handle.check_optimizer(optimizer, "AveragingOptimizer")
        # Not Optimizer.__init__: it would build new param groups; these are the inner ones.
        self.optimizer = optimizer
        self.handle = handle
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()  # step pre/post hooks, profiler range

    # --- the inner optimizer's own objects ------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's ``param_groups`` (the same list)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):
        """The inner optimizer's ``state`` (the same dict)."""
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict:
        """The inner optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.optimizer.defaults = value

    # --- stepping -------------------------------------------------------------------------
    def step(self, closure=None):
        """The inner optimizer's step, then ``handle.step()``; returns the closure's loss."""
        _check_not_attached(self.handle)
        loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self.handle.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The inner optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer (its parameters are not averaged)."""
        self.optimizer.add_param_group(param_group)

    # --- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The inner optimizer's state dict plus ``"averaging"``: ``handle.state_dict()``."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = dict(self.optimizer.state_dict())
        state_dict[_AVERAGING_KEY] = self.handle.state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the handle from ``"averaging"`` (if present), then the inner optimizer."""
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        averaging = state_dict.pop(_AVERAGING_KEY, None)
        if averaging is None:
            warnings.warn(
                "AveragingOptimizer.load_state_dict: the state dict has no 'averaging' entry "
                "(saved from a plain optimizer?); the averaging handle keeps its current "
                "step count and anchors",
                stacklevel=2,
            )
        else:
            self.handle.load_state_dict(averaging)
        self.optimizer.load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __getstate__(self) -> dict:
        return {"optimizer": self.optimizer, "handle": self.handle}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["optimizer"], state["handle"])

    def __repr__(self) -> str:
        inner = "\n".join("    " + line for line in repr(self.optimizer).splitlines())
        return f"AveragingOptimizer(\n{inner},\n    handle={self.handle!r}\n)"


def _check_not_attached(handle) -> None:
    if getattr(handle, "attached_optimizer", False):
        raise ValueError(
            "AveragingOptimizer: the handle was registered with optimizer=, so it already "
            "steps after every optimizer.step(); wrapping it too would step the schedule "
            "twice per step. Register without optimizer= to use AveragingOptimizer, or "
            "keep the plain optimizer"
        )
