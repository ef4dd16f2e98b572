"""Round observers: what looks at a finished round without changing it.

* :class:`ConsensusTracker` (``track_consensus=True``): the replicas' mean squared
  distance from their average, ``stats.consensus_distance``;
* :class:`AgreementCheck` (``verify=True``): the step counter and an exact checksum of
  every bucket, compared across ranks;
* :class:`RoundCallback` (``on_round=fn``): ``fn(handle)`` on every rank.

An observer measures locally before the write-back (:meth:`RoundObserver.measure`) and
reports after the round (:meth:`RoundObserver.report`). A *collective* observer's
report talks to the other ranks; after an overlapped round, which ranks apply at
different steps, the handle runs it at the next step all ranks share (the next round).

Example:
    >>> from ddp_avg_hooks.observers import make_observers
    >>> from ddp_avg_hooks.options import AveragingOptions
    >>> [type(o).__name__ for o in make_observers(AveragingOptions(verify=True))]
    ['AgreementCheck']
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import ops
from ._groups import is_member
from .collectives import backend_device, gather_small
from .errors import AveragingHookError


class RoundObserver:
    """Base class: measures nothing, reports nothing."""

    collective = False

    def measure(self, buckets, finished):
        """A local measurement of the collected round, before its write-back."""
        return None

    def report(self, handle, round_number: int, measured) -> None:
        """After the round (collective observers: at a step every rank shares)."""


@torch.no_grad()
def squared_distance(bucket, values: torch.Tensor, *, from_launch: bool = False,
                     change: bool = False) -> torch.Tensor:
    """``||params - values||^2`` of a bucket, in float64 (``from_launch``: its launch
    snapshot; ``change``: ``values`` is ``anchor - new``, as a delta result is)."""
    params = bucket.parameters()
    source = ops.split_like(bucket.launch_snapshot(), params) if from_launch else params
    anchors = ops.split_like(bucket.anchor(), params) if change else [None] * len(params)
    total = torch.zeros((), dtype=torch.float64, device=bucket.device)
    for p, v, a in zip(source, ops.split_like(values.reshape(-1), params), anchors):
        new = v.double() if a is None else a.double() - v.double()
        total += (p.double() - new).pow(2).sum()
    return total


class ConsensusTracker(RoundObserver):
    """``stats.consensus_distance``: mean over replicas of ``||params_r - average||^2``,
    over the whole model (with FSDP2, summed over the shards of each replica, so every
    rank reports the same number)."""

    collective = True

    def measure(self, buckets, finished):
        return sum((squared_distance(b, v, from_launch=finished.overlapped, change=c).cpu()
                    for b, v, c in zip(buckets, finished.results, finished.changes)),
                   torch.zeros((), dtype=torch.float64))

    def report(self, handle, round_number: int, measured) -> None:
        group = handle.process_group
        if not is_member(group):
            return
        total = measured.reshape(1).to(backend_device(group))
        dist.all_reduce(total, group=group)
        shards = handle.replica_group
        if shards is not None and dist.get_world_size(shards) > 1:
            dist.all_reduce(total, group=shards)  # each replica's shards add up
        handle.stats.consensus_distance = float(total) / dist.get_world_size(group)


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Order-independent exact checksum of ``t``'s bits (the same on any thread count)."""
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().reshape(-1).view(int_type).sum(dtype=torch.int64)


def bucket_checksum(bucket, *, anchor: bool = False) -> torch.Tensor:
    """The exact checksum of a bucket's parameters (as if flattened: integer sums add up),
    or of its stored anchor."""
    if anchor:
        return _checksum(bucket.stored_anchor())
    return sum((_checksum(p) for p in bucket.parameters()),
               torch.zeros((), dtype=torch.int64, device=bucket.device))


class AgreementCheck(RoundObserver):
    """Compare the step counter and an exact checksum of every bucket across ranks.

    Only the round's own buckets are compared (a fragment round averages its fragment).
    With overlapped rounds the replicas agree on the anchor, not the parameters, so the
    anchors are compared.
    """

    collective = True

    def __init__(self, overlap: bool) -> None:
        self._overlap = overlap

    def measure(self, buckets, rnd):
        return list(buckets)  # the round's buckets: the ones that must agree

    def report(self, handle, round_number: int, measured) -> None:
        group = handle.process_group
        if not is_member(group):
            return
        buckets = measured
        sums = [bucket_checksum(b, anchor=self._overlap and b.has_anchor()).cpu()
                for b in buckets]
        local = torch.stack([torch.tensor(handle.step_count, dtype=torch.int64), *sums])
        gathered = gather_small(local, group)
        name = handle.hook_name
        for rank, other in enumerate(gathered):
            if other[0] != gathered[0][0]:
                raise AveragingHookError(
                    f"verify=True: step counters differ after round {round_number} of "
                    f"{name!r}: group rank 0 is at step {int(gathered[0][0])}, "
                    f"group rank {rank} at {int(other[0])} (was a step skipped on one rank?)"
                )
            diff = (other[1:] != gathered[0][1:]).nonzero()
            if len(diff):
                raise AveragingHookError(
                    f"verify=True: after round {round_number} of {name!r}, "
                    f"bucket {buckets[int(diff[0])].index()} differs between group ranks 0 "
                    f"and {rank}"
                )


class RoundCallback(RoundObserver):
    """``fn(handle)`` after every round, on every rank."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def report(self, handle, round_number: int, measured) -> None:
        self._fn(handle)


class Reporter:
    """Runs a registration's observers around each finished round.

    Collective reports of an overlapped round wait in ``deferred`` until
    :meth:`report_deferred`, which the handle calls at the next step all ranks share.
    """

    def __init__(self, observers: list[RoundObserver]) -> None:
        self.observers = observers
        self.deferred: list = []

    def measure(self, buckets, finished) -> list:
        return [o.measure(buckets, finished) for o in self.observers]

    def report_collective(self, handle, number: int, measured: list, *, overlapped: bool) -> None:
        collective = [(o, m) for o, m in zip(self.observers, measured) if o.collective]
        if overlapped:
            self.deferred = [(o, number, m) for o, m in collective]
            return
        for observer, m in collective:
            observer.report(handle, number, m)

    def report_local(self, handle, number: int, measured: list) -> None:
        for observer, m in zip(self.observers, measured):
            if not observer.collective:
                observer.report(handle, number, m)

    def report_deferred(self, handle) -> None:
        """Report the collective measurements an overlapped round left waiting."""
        deferred, self.deferred = self.deferred, []
        for observer, number, m in deferred:
            observer.report(handle, number, m)


def make_observers(options) -> list[RoundObserver]:
    """The observers ``options`` asks for, in the order they report."""
    observers: list[RoundObserver] = []
    if options.track_consensus:
        observers.append(ConsensusTracker())
    if options.verify:
        observers.append(AgreementCheck(options.overlap))
    if options.on_round is not None:
        observers.append(RoundCallback(options.on_round))
    return observers
