"""Round policies: what else a round does to the model besides averaging parameters.

A policy offers extra buckets that the round averages exactly, beside the hook (their
bytes count in ``stats.bytes_sent``), and may act once every result is written back.

* :class:`BufferAveraging` (``average_buffers=True``): floating-point buffers, such as
  BatchNorm's running statistics.
* :class:`OptimizerStateAveraging` (``optimizer_state="average"``): the optimizer's
  per-parameter state tensors (momentum, Adam's moments).
* :class:`OptimizerStateReset` (``optimizer_state="reset"``): zero them instead.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.policies import BufferAveraging
    >>> bn = torch.nn.BatchNorm1d(4)
    >>> [b.numel() for b in BufferAveraging(list(bn.buffers())[:2], 25.0).buckets()]
    [8]
"""

from __future__ import annotations

import warnings

import torch

from .bucket import ParamBucket, assign_buckets
from .models import local_tensor


class RoundPolicy:
    """Base class: no extra buckets, nothing after the write-back."""

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
    tensors = []
    for p in params:
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and value.shape == p.shape and key != "step"):
                value = local_tensor(value)
                if value.numel():
                    tensors.append(value)
    return tuple(tensors)


class OptimizerStateAveraging(RoundPolicy):
    """Average the optimizer's state of ``params`` exactly at every round.

    The state appears at the first optimizer step and may be replaced (a loaded
    checkpoint), so its buckets are rebuilt whenever the tensors change.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list,
                 bucket_cap_mb: float) -> None:
        self._optimizer, self._params, self._cap = optimizer, params, bucket_cap_mb
        self._ids: tuple = ()
        self._buckets: list[ParamBucket] = []

    def buckets(self) -> list[ParamBucket]:
        tensors = optimizer_state_tensors(self._optimizer, self._params)
        if tuple(map(id, tensors)) != self._ids:
            self._ids = tuple(map(id, tensors))
            self._buckets = assign_buckets(tensors, self._cap) if tensors else []
        return self._buckets

    def held_buckets(self) -> list[ParamBucket]:
        return self._buckets


class OptimizerStateReset(RoundPolicy):
    """Zero the optimizer's state of ``params`` after every round."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list) -> None:
        self._optimizer, self._params = optimizer, params

    def after_write_back(self) -> None:
        tensors = optimizer_state_tensors(self._optimizer, self._params)
        if tensors:
            torch._foreach_zero_(list(tensors))


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
        policies.append(OptimizerStateAveraging(options.optimizer, params, options.bucket_cap_mb))
    elif options.optimizer_state == "reset":
        policies.append(OptimizerStateReset(options.optimizer, params))
    return policies
