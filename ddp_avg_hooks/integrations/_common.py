"""What the integrations share: one gradient comm hook per DDP model, and model checks."""

from __future__ import annotations

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import grad_hooks
from ..trees import map_tensors


def find_ddp(model) -> DistributedDataParallel | None:
    """``model`` itself, or the DDP inside ``torch.compile(ddp)``; ``None`` if neither."""
    model = getattr(model, "_orig_mod", model)
    return model if isinstance(model, DistributedDataParallel) else None


class GradSync:
    """The state of the one ``local_sgd_grad_hook`` an integration registers on a DDP model.

    DDP takes one comm hook per model, for its lifetime, while a framework may register an
    averaging hook several times on that model (``fit`` twice, a ``with`` block per
    phase). So the comm hook reads the current handle through this object: with a handle
    gradients follow its warm-up; with none (before, between and after registrations)
    they are averaged every step, as plain DDP does.
    """

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.handle = None
        self.grad_process_group = getattr(ddp, "process_group", None) or dist.group.WORLD

    @property
    def in_warmup(self) -> bool:
        return self.handle is None or self.handle.in_warmup

    @classmethod
    def attach(cls, ddp: DistributedDataParallel, handle) -> "GradSync":
        """Point ``ddp``'s gradient hook at ``handle``, registering the hook the first time."""
        sync = getattr(ddp, "_dah_grad_sync", None)
        if sync is None:
            sync = cls(ddp)
            ddp.register_comm_hook(sync, grad_hooks.local_sgd_grad_hook)
            ddp._dah_grad_sync = sync
        sync.handle = handle
        return sync


def detach(ddp: DistributedDataParallel | None) -> None:
    """Gradients of ``ddp`` are averaged every step again (no-op if nothing was attached)."""
    sync = getattr(ddp, "_dah_grad_sync", None)
    if sync is not None:
        sync.handle = None


def to_cpu(obj):
    """``obj`` with every tensor moved to the CPU (for ``all_gather_object``)."""
    return map_tensors(lambda t: t.detach().cpu(), obj)
