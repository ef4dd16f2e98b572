"""The collectives every round is built from: a completed future, a sum and an exact average.

The built-in hooks and the round engine (which averages buffers and optimizer state
exactly, beside the hook) share them, so an exact average is one piece of code.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.collectives import completed
    >>> completed(torch.ones(2)).wait().tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._groups import is_member

__all__ = ["allreduce_sum", "completed", "exact_average"]


def completed(value) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_sum(group: dist.ProcessGroup, tensor: torch.Tensor, bucket) -> torch.futures.Future:
    """Sum ``tensor`` in place across ``group``, counting its bytes on ``bucket``; a future
    of it."""
    bucket.record_sent(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def exact_average(group: dist.ProcessGroup, bucket) -> torch.futures.Future:
    """A future of the mean over ``group`` of ``bucket``'s parameters: divide, then sum.

    The same arithmetic as PyTorch's ``average_parameters``. When ``1 / world_size`` is
    exact (a power of two), the division is fused into the copy of the parameters,
    which gives the same bits. A rank outside ``group`` gets its own parameters back.
    """
    if not is_member(group):
        return completed(bucket.buffer())
    world_size = dist.get_world_size(group)
    if world_size & (world_size - 1) == 0:
        buffer = bucket.scaled_buffer(1.0 / world_size)
    else:
        buffer = bucket.buffer().div_(world_size)
    return allreduce_sum(group, buffer, bucket)
