"""Exact averaging: every rank ends the round with the mean of all replicas."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._groups import check_group, or_world
from ..bucket import ParamBucket
from ..collectives import exact_average
from ..protocol import averaging_hook


def _group(state) -> dist.ProcessGroup:
    return or_world(check_group(state, "allreduce_hook", what="state"))


@averaging_hook(validate_state=_group, linear=True)
def allreduce_hook(state, bucket: ParamBucket) -> torch.futures.Future:
    """Average the bucket's parameters exactly: ``new = sum_r(params_r / world_size)``.

    The same arithmetic as PyTorch's ``average_parameters`` (divide, then allreduce),
    so it gives the same results as ``PeriodicModelAverager``.

    Args:
        state: ``None`` for the default process group, or a ``ProcessGroup``. Ranks
            outside that group leave their parameters alone.
        bucket: the :class:`~ddp_avg_hooks.ParamBucket` to average.

    Returns:
        A future of the averaged flat parameters (``bucket.buffer()``, averaged in place).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.allreduce_hook, None, period=2)
        >>> [handle.step() for _ in range(4)]
        [True, False, True, False]
        >>> handle.remove(); dist.destroy_process_group()
    """
    return exact_average(_group(state), bucket)
