"""Gradient comm hooks for ``ddp.register_comm_hook`` that go with averaging.

They read the :class:`~ddp_avg_hooks.AveragingHandle`'s step counter, so the warm-up
of gradient averaging and the averaging schedule can never drift apart.
"""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


# No `from __future__ import annotations`: DDP compares the annotations themselves.
def local_sgd_grad_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average gradients during the handle's warm-up, keep them local afterwards.

    While ``state.in_warmup`` this is DDP's usual gradient averaging over the DDP
    model's process group; after it, gradients stay local and the parameters are
    averaged by the handle's rounds instead.

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
    try:
        in_warmup = state.in_warmup
    except AttributeError:
        raise TypeError(
            "local_sgd_grad_hook: state must be the AveragingHandle returned by "
            f"register_averaging_hook, got {type(state).__name__}"
        ) from None
    if in_warmup:
        return default_hooks.allreduce_hook(state.grad_process_group, bucket)
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
