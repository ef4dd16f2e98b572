"""What a registration holds in memory, counted from its tensors, by kind and by device.

Kinds:

* ``bucket_buffers``: each bucket's flat buffer (the round's scratch space);
* ``anchors``: the parameters as of the last round, for hooks that send the change;
* ``scratch``: other buffers reused from round to round (``delta()`` outputs, the launch
  snapshot of an overlapped round, hooks' send buffers);
* ``residuals``: error-feedback memory (in ``bucket.memory()`` or in the hook state);
* ``hook_state``: any other tensor the hook state holds (PowerSGD's factors, the outer
  optimizer's parameters and moments);
* ``policies``: the buckets of averaged buffers and optimizer state.

A tensor is counted once, at its storage's size, however many places refer to it.
Each part is asked for its tensors: a bucket by ``bucket.memory_tensors()`` (its
buffers, anchor, scratch and ``memory()``), a hook state by its ``memory_tensors()``
method, which yields ``(kind, tensor)`` pairs; a state without one counts every tensor
reachable from it as ``hook_state``.

Example:
    >>> import torch, torch.distributed as dist
    >>> import ddp_avg_hooks as dah
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))  # 10 floats
    >>> handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook, None)
    >>> handle.average()
    >>> report = {kind: d.get("cpu", 0) for kind, d in handle.memory_bytes().items()}
    >>> report  # doctest: +NORMALIZE_WHITESPACE
    {'bucket_buffers': 0, 'anchors': 40, 'scratch': 20, 'residuals': 20,
     'hook_state': 0, 'policies': 0}
    >>> handle.remove(); dist.destroy_process_group()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

KINDS = ("bucket_buffers", "anchors", "scratch", "residuals", "hook_state", "policies")


def _walk(obj, kind: str, seen: set) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``obj`` (containers, optimizers, plain objects)."""
    if isinstance(obj, torch.Tensor):
        yield kind, obj
        return
    if obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module)) \
            or callable(obj) and not hasattr(obj, "__dict__") or id(obj) in seen:
        return
    seen.add(id(obj))
    own = getattr(obj, "memory_tensors", None)
    if callable(own) and not isinstance(obj, type):
        for k, value in own():
            yield from _walk(value, k, seen)
        return
    if isinstance(obj, torch.optim.Optimizer):
        yield from _walk(list(obj.state.values()), kind, seen)
        yield from _walk([p for g in obj.param_groups for p in g["params"]], kind, seen)
        return
    if isinstance(obj, dict):
        values: Iterable = obj.values()
    elif isinstance(obj, (list, tuple, set)):
        values = obj
    else:
        names = list(getattr(obj, "__dict__", {}))
        for cls in type(obj).__mro__:
            names += [s for s in getattr(cls, "__slots__", ()) if isinstance(s, str)]
        values = [getattr(obj, n) for n in names if hasattr(obj, n)]
    for value in values:
        yield from _walk(value, kind, seen)


def _bucket_tensors(bucket, kind_of_buffer: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A policy bucket's tensors all count as ``policies`` (its buffer and, with overlap,
    its launch snapshot); another bucket's buffer as ``kind_of_buffer``, the rest by kind."""
    for kind, t in bucket.memory_tensors():
        yield (kind_of_buffer if kind == "bucket_buffers" or kind_of_buffer == "policies"
               else kind), t


def count(buckets, hook_state, policy_buckets=()) -> dict[str, dict[str, int]]:
    """Bytes by kind and device of ``buckets``, ``hook_state`` and ``policy_buckets``.

    Each part says what it holds: a bucket by ``bucket.memory_tensors()``, a hook state by
    ``memory_tensors()`` if it has one (else every tensor reachable from it).
    """
    pairs: list = []
    for bucket in buckets:
        pairs += _bucket_tensors(bucket, "bucket_buffers")
    for bucket in policy_buckets:
        pairs += _bucket_tensors(bucket, "policies")
    pairs += _walk(hook_state, "hook_state", set())
    report: dict[str, dict[str, int]] = {kind: {} for kind in KINDS}
    storages = set()
    for kind, t in pairs:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key in storages or storage.nbytes() == 0:
            continue
        storages.add(key)
        per_device = report[kind]
        per_device[str(t.device)] = per_device.get(str(t.device), 0) + storage.nbytes()
    return report


def total(report: dict[str, dict[str, int]]) -> int:
    """All bytes of a :func:`count` report."""
    return sum(sum(per_device.values()) for per_device in report.values())
