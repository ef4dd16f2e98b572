"""Gradient hooks that go with averaging: a comm hook for DDP, all-reduce hooks for FSDP2.

They read the :class:`~ddp_avg_hooks.AveragingHandle`'s step counter, so the warm-up
of gradient averaging and the averaging schedule can never drift apart.
"""

import inspect
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from .models import fsdp_modules


# No `from __future__ import annotations`: DDP compares the annotations themselves.
def local_sgd_grad_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average gradients during the handle's warm-up, keep them local afterwards.

    While ``state.in_warmup`` this is DDP's usual gradient averaging over the DDP
    model's process group; after it, gradients stay local and the parameters are
    averaged by the handle's rounds instead. Registered as the comm hook itself, from
    the first backward after the warm-up on it has DDP skip its gradient reducer
    altogether, as inside ``ddp.no_sync()``, where the reducer has nothing else to do
    (see :class:`ReducerSwitch`): each backward is then the bare module's, with the same
    gradients. DDP keeps a comm hook for the model's lifetime: once the handle is
    removed, the hook follows the handle registered on the model after it
    (``handle.successor``), and while there is none averages gradients every step, as
    plain DDP does.

    Args:
        state: the :class:`~ddp_avg_hooks.AveragingHandle` returned by
            ``register_averaging_hook`` for this model.
        bucket: DDP's gradient bucket.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
        ...                                      period=4, warmup_steps=1)
        >>> ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
        >>> handle.in_warmup
        True
        >>> ddp(torch.randn(2, 4)).sum().backward(); handle.step()  # warm-up step
        False
        >>> handle.in_warmup  # from now on gradients stay local
        False
        >>> handle.remove(); dist.destroy_process_group()
    """
    if getattr(state, "removed", False):
        successor = state.successor
        if successor is None:  # averaging stopped: plain DDP
            return default_hooks.allreduce_hook(state.grad_process_group, bucket)
        state = successor
    try:
        in_warmup = state.in_warmup
    except AttributeError:
        raise TypeError(
            "local_sgd_grad_hook: state must be the AveragingHandle returned by "
            f"register_averaging_hook, got {type(state).__name__}"
        ) from None
    averages = getattr(state, "averages", None)
    if averages is not None and not any(averages(p) for p in bucket.parameters()):
        raise ValueError(
            "local_sgd_grad_hook: the AveragingHandle given as the comm hook's state averages "
            "another model, so this model's gradients would stay local and its parameters "
            "never be averaged; pass ddp.register_comm_hook the handle that "
            "register_averaging_hook returned for this DDP model")
    if in_warmup:
        return default_hooks.allreduce_hook(state.grad_process_group, bucket)
    switch = getattr(state, "reducer_switch", None)
    if switch is not None:
        switch.skip_reducer()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class ReducerSwitch:
    """Turns DDP's gradient reducer off once :func:`local_sgd_grad_hook` keeps gradients
    local, and on again when they must be averaged.

    After the warm-up the hook hands every bucket back unchanged, so the reducer's work
    at each backward (copying gradients into its buckets and back) changes nothing. From
    the next forward on, the DDP model then runs as inside ``ddp.no_sync()``
    (``require_backward_grad_sync = False``). The reducer stays on where it has more to
    do than call the hook: with ``find_unused_parameters=True`` (it zero-fills the
    gradients of unused parameters), ``static_graph=True``, DDP's own mixed precision,
    or ``broadcast_buffers=True`` on a module with buffers (DDP broadcasts them at every
    synchronized forward). It also stays on unless the comm hook registered on the model
    is ``local_sgd_grad_hook`` itself, or a wrapper of it made with ``functools.wraps``
    (which declares that it hands the buckets through): a hook of your own that calls
    it, to change or log the gradients, is called at every backward, as DDP does.

    An :class:`~ddp_avg_hooks.AveragingHandle` of a DDP model holds one as
    ``handle.reducer_switch``: it turns the reducer back on when the handle is back in
    its warm-up (``load_state_dict`` of an earlier step) and when it is removed. Remove
    it outside ``ddp.no_sync()``: on leaving, ``no_sync`` restores the value it found on
    entry, which with the reducer off is ``False``.

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None,
        ...                                      period=4, warmup_steps=1)
        >>> ddp.register_comm_hook(handle, dah.grad_hooks.local_sgd_grad_hook)
        >>> for _ in range(2):
        ...     ddp(torch.randn(2, 4)).sum().backward(); _ = handle.step()
        >>> handle.reducer_switch.skipping, ddp.require_backward_grad_sync
        (True, False)
        >>> handle.remove(); ddp.require_backward_grad_sync  # the reducer is back on
        True
        >>> dist.destroy_process_group()
    """

    def __init__(self, ddp) -> None:
        # weak: DDP's reducer holds the hook's state (the handle, which holds this), and
        # a strong reference back would keep the model alive for good
        self._ddp = weakref.ref(ddp)
        self.skipping = False
        self.active = True

    @property
    def ddp(self):
        """The DDP model (``None`` once it is freed)."""
        return self._ddp()

    def reducer_needed(self) -> str | None:
        """Why the reducer must keep running at every backward (``None``: it need not)."""
        ddp = self.ddp
        if ddp is None:
            return "the DDP model is gone"
        if getattr(ddp, "find_unused_parameters", False):
            return "find_unused_parameters=True"
        if getattr(ddp, "static_graph", False):
            return "static_graph=True"
        if getattr(ddp, "mixed_precision", None) is not None:
            return "mixed_precision"
        if getattr(ddp, "broadcast_buffers", False) and any(True for _ in ddp.module.buffers()):
            return "broadcast_buffers=True on a module with buffers"
        hooks = getattr(ddp, "_comm_hooks", None)  # what DDP.register_comm_hook recorded
        if not hooks or any(inspect.unwrap(hook) is not local_sgd_grad_hook for hook, _ in hooks):
            return ("the registered comm hook is not local_sgd_grad_hook itself (or a "
                    "functools.wraps wrapper of it): DDP calls it at every backward")
        return None

    def skip_reducer(self) -> None:
        """Turn the reducer off from the next forward on, unless the switch was released
        or the reducer is needed (:meth:`reducer_needed`, asked once: the model's settings
        do not change, so a needed reducer releases the switch for good)."""
        if not self.active or self.skipping:
            return
        if self.reducer_needed() is not None:
            self.active = False
            return
        self.ddp.require_backward_grad_sync = False
        self.skipping = True

    def follow(self, in_warmup: bool) -> None:
        """Turn the reducer back on if gradients must be averaged again (``in_warmup``)."""
        if in_warmup and self.skipping:
            ddp = self.ddp
            if ddp is not None:
                ddp.require_backward_grad_sync = True
            self.skipping = False

    def release(self) -> None:
        """Turn the reducer back on for good: the hook no longer turns it off
        (:meth:`AveragingHandle.remove <ddp_avg_hooks.AveragingHandle.remove>` calls it;
        call it after registering to keep DDP's reducer running)."""
        self.follow(True)
        self.active = False


class FSDPGradHooks:
    """What :func:`register_fsdp_grad_hooks` returns: ``remove()`` stops the averaging
    across replicas (the hooks then leave every gradient shard as it is)."""

    def __init__(self, handle, modules: list) -> None:
        self.handle, self.modules, self.active = handle, modules, True

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if not (self.active and self.handle.in_warmup):
            return
        group = self.handle.process_group
        reduce_output.div_(dist.get_world_size(group))
        dist.all_reduce(reduce_output, group=group)

    def remove(self) -> None:
        """Keep gradients inside the replica group from now on, also during a warm-up."""
        self.active = False


def register_fsdp_grad_hooks(model: torch.nn.Module, handle) -> FSDPGradHooks:
    """The FSDP2 counterpart of :func:`local_sgd_grad_hook`: gradient averaging across
    replicas during the handle's warm-up only.

    On every FSDP2 module inside ``model`` (``fully_shard`` on a 1-D mesh per replica
    group), this installs an all-reduce hook (``FSDPModule.set_all_reduce_hook``): each
    reduce-scattered gradient shard, already averaged inside the replica group, is
    averaged over the handle's process group, the replicate group, while
    ``handle.in_warmup`` (divide, then sum, as DDP does): every replica then takes the
    same step, as native HSDP does. After the warm-up nothing crosses replicas per step;
    the reduce-scatter inside the replica group is untouched. It reads the handle's
    counter: there is one step counter, never two to keep equal.

    Args:
        model: the FSDP2 root registered with ``register_averaging_hook``.
        handle: the :class:`~ddp_avg_hooks.AveragingHandle` of that registration.

    Returns:
        An :class:`FSDPGradHooks` (``remove()`` turns the averaging off).
    """
    if not all(hasattr(handle, a) for a in ("in_warmup", "process_group")):
        raise TypeError(
            "register_fsdp_grad_hooks: handle must be the AveragingHandle returned by "
            f"register_averaging_hook, got {type(handle).__name__}"
        )
    modules = fsdp_modules(model)
    if not modules:
        raise TypeError(
            "register_fsdp_grad_hooks: model holds no FSDP2 module (fully_shard); for a "
            "DistributedDataParallel model use ddp.register_comm_hook(handle, "
            "grad_hooks.local_sgd_grad_hook)"
        )
    averages = getattr(handle, "averages", None)
    if averages is not None and not any(averages(p) for p in model.parameters()):
        raise ValueError(
            "register_fsdp_grad_hooks: the handle averages another model; pass the handle "
            "that register_averaging_hook returned for this FSDP2 model")
    hooks = FSDPGradHooks(handle, modules)
    for module in modules:
        module.set_all_reduce_hook(hooks)
    return hooks
