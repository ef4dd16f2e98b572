"""Round policies: what else a round does to the model besides averaging parameters.

A policy offers extra buckets that the round averages exactly, beside the hook (their
bytes count in ``stats.bytes_sent``), and may act once every result is written back.

* :class:`BufferAveraging` (``average_buffers=True``): floating-point buffers, such as
  BatchNorm's running statistics.
* :class:`OptimizerStateAveraging` (``optimizer_state="average"``): the optimizer's
  per-parameter state tensors (momentum, Adam's moments).
* :class:`OptimizerStateReset` (``optimizer_state="reset"``): empty it instead, so that
  the next step starts it afresh, as a new optimizer's.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.policies import BufferAveraging
    >>> bn = torch.nn.BatchNorm1d(4)
    >>> [b.numel() for b in BufferAveraging(list(bn.buffers())[:2], 25.0).buckets()]
    [8]
"""

from __future__ import annotations

import hashlib
import warnings

import torch
import torch.distributed as dist

from .bucket import ParamBucket, assign_buckets
from .collectives import gather_small
from .errors import SettingsMismatchError
from .models import local_tensor


class RoundPolicy:
    """Base class: no extra buckets, nothing after the write-back."""

    #: whether the buckets can change between rounds, and so differ between ranks
    #: (they are then checked to agree before each round sends them)
    changing = False

    def describe(self) -> list:
        """What this rank's buckets hold, for a message when the ranks' differ."""
        return []

    def buckets(self) -> list[ParamBucket]:
        """Buckets to average exactly in this round (launched after the hook's)."""
        return []

    def after_write_back(self) -> None:
        """Runs once the round's results are in the parameters."""

    def held_buckets(self) -> list[ParamBucket]:
        """The buckets this policy holds now (for accounting: builds nothing)."""
        return self.buckets()


class BufferAveraging(RoundPolicy):
    """Average ``buffers`` (floating-point tensors) exactly at every round."""

    def __init__(self, buffers: list[torch.Tensor], bucket_cap_mb: float) -> None:
        self._buckets = assign_buckets(buffers, bucket_cap_mb) if buffers else []

    def buckets(self) -> list[ParamBucket]:
        return self._buckets


def optimizer_state_tensors(optimizer: torch.optim.Optimizer, params) -> tuple:
    """Floating-point state tensors shaped like their parameter (momentum, moments); of
    a sharded (DTensor) parameter, the local shard of its state."""
    return tuple(value for p in params for _, value in _averaged_state(optimizer, p))


def _averaged_state(optimizer: torch.optim.Optimizer, p) -> list[tuple]:
    """``(key, local tensor)`` of ``p``'s state that rounds average, sorted by key."""
    out = []
    for key, value in sorted(optimizer.state.get(p, {}).items()):
        if (isinstance(value, torch.Tensor) and value.is_floating_point()
                and value.shape == p.shape and key != "step"):
            value = local_tensor(value)
            if value.numel():
                out.append((key, value))
    return out


class OptimizerStateAveraging(RoundPolicy):
    """Average the optimizer's state of ``params`` exactly at every round.

    The state appears at the first optimizer step and may be replaced (a loaded
    checkpoint), so its buckets are rebuilt whenever the tensors change.
    """

    changing = True

    def __init__(self, optimizer: torch.optim.Optimizer, params: list,
                 bucket_cap_mb: float, names: list[str] | None = None) -> None:
        self._optimizer, self._params, self._cap = optimizer, params, bucket_cap_mb
        self._names = names or [f"parameter {i}" for i in range(len(params))]
        self._ids: tuple = ()
        self._buckets: list[ParamBucket] = []

    def describe(self) -> list:
        """Per parameter, its name and the state tensors averaged (``(key, shape)``)."""
        return [(name, [(k, tuple(v.shape)) for k, v in _averaged_state(self._optimizer, p)])
                for name, p in zip(self._names, self._params)]

    def buckets(self) -> list[ParamBucket]:
        tensors = optimizer_state_tensors(self._optimizer, self._params)
        if tuple(map(id, tensors)) != self._ids:
            self._ids = tuple(map(id, tensors))
            self._buckets = assign_buckets(tensors, self._cap) if tensors else []
        return self._buckets

    def held_buckets(self) -> list[ParamBucket]:
        return self._buckets


class OptimizerStateReset(RoundPolicy):
    """Empty the optimizer's state of ``params`` after every round, as a new optimizer's
    is: its next step builds the state again as its first step would (momentum from that
    step's gradient, Adam's moments from zero with the bias correction of step 1, Rprop's
    step sizes from ``lr``). PyTorch's optimizers build their state at their first step;
    one that builds it in its constructor cannot be reset."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list) -> None:
        self._optimizer, self._params = optimizer, params

    def after_write_back(self) -> None:
        for p in self._params:
            self._optimizer.state.pop(p, None)


def check_buckets_agree(policies: list[RoundPolicy], buckets: list[ParamBucket], group,
                        where: str) -> None:
    """Raise :class:`~ddp_avg_hooks.errors.SettingsMismatchError` on every rank of
    ``group`` unless all hold ``buckets`` (the policies' of this round) of the same sizes
    and dtypes: averaging buckets that differ would abort the process or hang.
    Collective on ``group`` (one all-gather of an int64 hash of the layout; a gather of
    the policies' descriptions only when they differ)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    layout = repr([(b.numel(), str(b.dtype)) for b in buckets]).encode()
    mine = int.from_bytes(hashlib.blake2b(layout, digest_size=7).digest(), "little")
    if all(int(h) == mine for h in gather_small(torch.tensor([mine]), group)):
        return
    described: list = [None] * world
    dist.all_gather_object(described, [entry for p in policies for entry in p.describe()],
                           group=group)
    ranks = dist.get_process_group_ranks(group)
    first = next(i for i, d in enumerate(described) if d != described[0])
    where_differs = next(
        (f"{a[0]!r} holds {a[1] or 'no state'} on rank {ranks[0]}, {b[1] or 'no state'} on "
         f"rank {ranks[first]}" for a, b in zip(described[0], described[first]) if a != b),
        "the buffers differ")
    raise SettingsMismatchError(
        f"{where}: the ranks' optimizer state (or buffers) averaged with the round differ, "
        f"so they cannot be averaged: {where_differs}. Every rank must step the same "
        "optimizer class with the same settings, and every parameter must get a gradient "
        "on every rank before a round (a parameter that got none on one rank has no "
        "optimizer state there); or register with optimizer_state='keep'")


def make_policies(options, model, params: list) -> list[RoundPolicy]:
    """The policies ``options`` (an :class:`~ddp_avg_hooks.options.AveragingOptions`) asks
    for, over ``model`` (a :class:`~ddp_avg_hooks.models.AveragedModel`) whose averaged
    parameters, in bucket order, are ``params`` (the optimizer's state keys)."""
    policies: list[RoundPolicy] = []
    if options.average_buffers:
        if model.broadcast_buffers:
            warnings.warn(
                "average_buffers=True with DistributedDataParallel(broadcast_buffers=True): "
                "DDP already overwrites every rank's buffers with rank 0's at each forward, "
                "so averaging them is wasted; construct DDP with broadcast_buffers=False",
                stacklevel=3,
            )
        policies.append(BufferAveraging(model.buffers(), options.bucket_cap_mb))
    if options.optimizer_state == "average":
        name_of = {id(k): n for k, n in zip(model.keys, model.names)}
        policies.append(OptimizerStateAveraging(options.optimizer, params, options.bucket_cap_mb,
                                                names=[name_of.get(id(p), "?") for p in params]))
    elif options.optimizer_state == "reset":
        policies.append(OptimizerStateReset(options.optimizer, params))
    return policies
