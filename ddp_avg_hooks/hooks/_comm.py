"""Small communication helpers shared by the built-in averaging hooks."""

from __future__ import annotations

import torch
import torch.distributed as dist


def completed(value: torch.Tensor) -> torch.futures.Future:
    """A future that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_sum_fut(group: dist.ProcessGroup, tensor: torch.Tensor, bucket) -> torch.futures.Future:
    """Sum ``tensor`` in place across ``group``, counting the bytes sent; a future of it."""
    bucket.record_sent(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
