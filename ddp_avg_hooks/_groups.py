"""Process-group helpers: what counts as a group, membership, and where a state keeps one.

Example:
    >>> import torch.distributed as dist
    >>> from ddp_avg_hooks._groups import check_group, group_of_state
    >>> check_group(None, "MyState") is None, group_of_state(object()) is None
    (True, True)
"""

from __future__ import annotations

import torch.distributed as dist


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


def check_group(group, owner: str, *, what: str = "process_group", also: str = ""):
    """``group`` if it is ``None`` (the default group) or a process group, else ``TypeError``.

    The message names ``owner`` and the argument (``what``); ``also`` names another kind
    the argument accepts (a hook's state class, say).
    """
    if group is None or is_group(group):
        return group
    accepted = (f"None (the default group), a torch.distributed.ProcessGroup or {also}" if also
                else "None (the default group) or a torch.distributed.ProcessGroup")
    raise TypeError(f"{owner}: {what} must be {accepted}, got {type(group).__name__}")


def or_world(group):
    """``group``, or the default group when it is ``None``."""
    return dist.group.WORLD if group is None else group


def group_of_state(state):
    """The process group a hook state names: the state itself, its ``process_group``, or
    ``None``."""
    if is_group(state):
        return state
    group = getattr(state, "process_group", None)
    return group if is_group(group) else None
