"""State-dict trees (dicts, lists and tuples of tensors and plain values): copies and maps.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.trees import map_tensors
    >>> map_tensors(lambda t: t * 2, {"a": [torch.ones(2)], "n": 3})
    {'a': [tensor([2., 2.])], 'n': 3}
"""

from __future__ import annotations

import torch

__all__ = ["clone_tree", "map_tensors"]


def map_tensors(fn, obj):
    """A copy of a state-dict tree (dicts, lists, tuples) with ``fn`` applied to every tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def clone_tree(obj):
    """A copy of a state-dict tree with every tensor cloned (no aliasing either way)."""
    return map_tensors(lambda t: t.detach().clone(), obj)
