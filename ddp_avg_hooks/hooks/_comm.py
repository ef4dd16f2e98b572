"""Small communication helpers shared by the built-in averaging hooks."""

from __future__ import annotations

import torch
import torch.distributed as dist


def resolve_group(state: object, hook_name: str) -> dist.ProcessGroup:
    """The process group a hook averages over: ``state`` itself, or the default group.

    Raises ``TypeError`` for anything that is neither ``None`` nor a process group.
    """
    if state is None:
        return dist.group.WORLD
    if is_group(state):
        return state
    raise TypeError(
        f"{hook_name}: state must be None (the default group) or a "
        f"torch.distributed.ProcessGroup, got {type(state).__name__}"
    )


def _is_non_member_marker(obj: object) -> bool:
    # what dist.new_group() returns on ranks outside the group
    marker = dist.GroupMember.NON_GROUP_MEMBER
    return obj is marker or (type(obj) is type(marker) and obj == marker)


def is_group(obj: object) -> bool:
    """A process group, or the marker ``new_group`` hands to ranks outside one."""
    return isinstance(obj, dist.ProcessGroup) or _is_non_member_marker(obj)


def is_member(group) -> bool:
    """Whether this rank belongs to ``group`` (ranks outside it leave parameters alone)."""
    return not _is_non_member_marker(group) and dist.get_rank(group) >= 0


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


def allreduce_mean_fut(group: dist.ProcessGroup, tensor: torch.Tensor, bucket) -> torch.futures.Future:
    """Average ``tensor`` in place across ``group``; returns a future of ``tensor``.

    Divides before summing (no overflow in half precision) and counts the bytes sent.
    """
    tensor.div_(dist.get_world_size(group))
    return allreduce_sum_fut(group, tensor, bucket)
