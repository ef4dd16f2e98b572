"""Half-precision averaging of the parameter *change*: ``fp16_compress_hook``,
``bf16_compress_hook``.

Rounding the parameters themselves to half precision is a trap: a parameter of
magnitude 20 has an fp16 spacing of 2**-6 (0.016) and a bf16 spacing of 2**-3, so
every update smaller than that vanishes at each round. These hooks send the change
since the last round instead, ``delta = anchor - params`` (small, so its relative
precision is what counts), and compute the new parameters in the parameters' dtype::

    h_r = half(delta_r / world_size + e_r)           # divide first: no fp16 overflow
    e_r <- delta_r / world_size + e_r - h_r           # error feedback (on by default)
    new = anchor - allreduce_sum(h)                   # in the bucket's dtype

Memory: besides the anchor (one copy of the parameters, needed to send the change) a
bucket holds its half-precision send buffer, which the allreduce sums in place and the
round engine applies as ``anchor - sum`` straight into the parameters
(``bucket.mark_result_as_delta()``), and the residual, kept in bfloat16 by default: in
all 2x the parameters' size for float32 parameters (1.5x without error feedback).

Where the error-feedback residual ``e_r`` lives:

* ``state`` is a :class:`HalfDeltaState`: in the state, keyed by ``bucket.index()``,
  and saved by ``state_dict()`` (so ``handle.state_dict()`` checkpoints it).
* ``state`` is ``None`` or a ``ProcessGroup`` (as for DDP's ``fp16_compress_hook``):
  error feedback is still on, and the residual lives with the bucket itself, in
  ``bucket.memory()``: it exists exactly as long as the registration, and
  ``handle.state_dict()`` saves it like the anchors.

Error bounds, per element (``u`` = unit roundoff: 2**-11 for fp16, 2**-8 for bf16;
``s`` = 2**-25, half of fp16's smallest subnormal, 0 for bf16; ``d`` = a rank's
``|delta| / world_size``, ``S`` = the round's ``|sum of d|``; ``v`` = the residual's unit
roundoff: 2**-8 for the default bfloat16, 2**-24 for float32; all tested in
``tests/test_compress_hooks.py``):

* each rank's own rounding costs at most ``u * d + s`` per round. Without error
  feedback these errors are lost and, for a persistent update direction, add up
  linearly over rounds; updates with ``d < 2**-25`` never move the parameters at all.
  With error feedback they are carried instead of lost, up to the rounding of the
  residual itself (at most ``v`` of it): after ``R`` rounds their total stays below
  ``(1 + R * v) * (u * d + s)`` per rank (with the float64 residual of a float64
  bucket, ``residual_dtype=None``, below ``u * d + s`` at any round count), and tiny
  updates are sent once their sum is large enough. At 1000 rounds a bfloat16 residual
  keeps under 5 roundings' worth of error, against 1000 without error feedback.
* the allreduce sums the half values in half precision (gloo and NCCL alike): up to
  ``world_size - 1`` roundings of at most ``u * S + s`` per round. No rank can see that
  error, so error feedback cannot recover it; it is unbiased but, in the worst case,
  adds up to ``rounds * (world_size - 1) * (u * S + s)``, i.e. a relative error of
  about ``(world_size - 1) * u`` of the distance the parameters travelled (fp16:
  0.05% at two ranks), never a loss of the updates themselves.
* ``delta / world_size`` must stay below 65504 for fp16 (bf16 has float32's range).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._groups import is_member
from ..bucket import ParamBucket
from ..collectives import allreduce_sum, completed
from ..protocol import averaging_hook
from ._delta import DeltaHookFamily, DeltaState

#: The residual's dtype when none is given; it loses at most 2**-8 of what it carries.
DEFAULT_RESIDUAL_DTYPE = torch.bfloat16
_FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class HalfDeltaState(DeltaState):
    """Options and error feedback of :func:`fp16_compress_hook` and :func:`bf16_compress_hook`.

    Args:
        process_group: group to average over; ``None`` means the default group.
        error_feedback: carry each round's rounding residual into the next round's
            delta (default ``True``). ``False`` gives the stateless behaviour of DDP's
            ``fp16_compress_hook``, applied to the delta.
        residual_dtype: the residual's dtype (default ``torch.bfloat16``: half the
            memory of a float32 one, and it loses at most ``2**-8`` of what it carries
            per round; see the module docstring's bounds). ``None``: the bucket's dtype.

    One state per registration (a second live registration with it is refused):
    residuals are keyed by ``bucket.index()``. ``state_dict()`` holds this rank's
    residuals (they differ between ranks).

    Example:
        >>> import torch
        >>> from ddp_avg_hooks.hooks import HalfDeltaState
        >>> state = HalfDeltaState(error_feedback=True)
        >>> state.state_dict()
        {'error_feedback': True, 'residual_dtype': 'bfloat16', 'residuals': {}}
        >>> HalfDeltaState(error_feedback="yes")
        Traceback (most recent call last):
        ...
        TypeError: HalfDeltaState: error_feedback must be True or False, got 'yes'
    """

    __slots__ = ("residual_dtype",)
    owner = "HalfDeltaState"

    def __init__(self, process_group: dist.ProcessGroup | None = None, error_feedback: bool = True,
                 residual_dtype: torch.dtype | None = DEFAULT_RESIDUAL_DTYPE) -> None:
        if residual_dtype is not None and residual_dtype not in _FLOAT_DTYPES:
            raise TypeError(
                "HalfDeltaState: residual_dtype must be None (the bucket's dtype) or one of "
                f"torch.float32, float64, float16, bfloat16; got {residual_dtype!r}"
            )
        self.residual_dtype = residual_dtype
        super().__init__(process_group, error_feedback)

    def new_residual(self, bucket: ParamBucket) -> torch.Tensor:
        return bucket.new_state(self.residual_dtype)

    def settings(self) -> dict:
        dtype = None if self.residual_dtype is None else str(self.residual_dtype).split(".")[-1]
        return {"error_feedback": self.error_feedback, "residual_dtype": dtype}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore residuals saved by :meth:`state_dict` (before or after the first round).

        They are kept in this state's ``residual_dtype``, whatever dtype they were saved in.
        """
        super().load_state_dict(state_dict)

    def __setstate__(self, s: dict) -> None:
        name = s["residual_dtype"]
        self.__init__(None, s["error_feedback"], None if name is None else getattr(torch, name))
        self.load_state_dict(s)

    def __repr__(self) -> str:
        return (
            f"HalfDeltaState(process_group={self.process_group!r}, "
            f"error_feedback={self.error_feedback}, residual_dtype={self.residual_dtype})"
        )


_FAMILY = DeltaHookFamily(
    HalfDeltaState, "half_residual", lambda b: b.new_state(DEFAULT_RESIDUAL_DTYPE),
    "a HalfDeltaState(process_group=..., error_feedback=...)")
_VALIDATORS = {torch.float16: _FAMILY.validator("fp16_compress_hook"),
               torch.bfloat16: _FAMILY.validator("bf16_compress_hook")}


def _half_delta_hook(state, bucket: ParamBucket, half_dtype: torch.dtype) -> torch.futures.Future:
    _VALIDATORS[half_dtype](state)
    group, residual = _FAMILY.group_and_residual(state, bucket)
    if not is_member(group):
        return completed(bucket.buffer())
    scale = 1.0 / dist.get_world_size(group)
    # state in host memory: one bucket at a time (see ddp_avg_hooks.storage), unless the
    # round overlaps training, which must not wait for it
    one_at_a_time = bucket.offloaded and not bucket.overlapped
    # bucket.delta's own scratch is the send buffer, unless it must be freed at once
    send = torch.empty(bucket.numel(), dtype=half_dtype, device=bucket.device) \
        if one_at_a_time else None
    # one chunked pass: (anchor - params) / ws rounded to half, and with error feedback
    # what the rounding lost goes into the residual
    send = bucket.delta(half_dtype, scale=scale, out=send, residual=residual)
    # the summed half values are the result: the engine writes anchor - sum(h) in the
    # bucket's dtype (half -> float is exact), with no bucket-size float buffer
    bucket.mark_result_as_delta()
    if one_at_a_time:
        bucket.record_sent(send)
        dist.all_reduce(send, group=group)
        return completed(send.cpu())  # the device buffer is free for the next bucket
    return allreduce_sum(group, send, bucket)


@averaging_hook(needs_anchor=True, validate_state=_VALIDATORS[torch.float16],
                prepare_bucket=_FAMILY.prepare_bucket, linear=True,
                settings=_FAMILY.settings)
def fp16_compress_hook(state, bucket: ParamBucket) -> torch.futures.Future:
    """Average the parameter change since the last round, sent as float16.

    ``new = anchor - allreduce(fp16(delta / world_size + e))`` with ``delta = anchor -
    params`` and error feedback ``e`` (see the module docstring for where it lives and
    the error bounds). The parameters never pass through half precision; the new
    values are computed in the bucket's dtype. Sends 2 bytes per parameter.

    Args:
        state: ``None`` (default group) or a ``ProcessGroup``: error feedback on, its
            residual kept in ``bucket.memory()`` (saved by ``handle.state_dict()``);
            or a :class:`HalfDeltaState` for options (error feedback off, say).
        bucket: the :class:`~ddp_avg_hooks.ParamBucket` to average.

    Returns:
        A future of the averaged change ``anchor - new`` in float16 (the bucket is marked
        with ``mark_result_as_delta()``).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.fp16_compress_hook, None, period=2)
        >>> # 10 params x 2 bytes x 2 rounds
        >>> [handle.step() for _ in range(3)], handle.stats.bytes_sent
        ([True, False, True], 40)
        >>> handle.remove(); dist.destroy_process_group()
    """
    return _half_delta_hook(state, bucket, torch.float16)


@averaging_hook(needs_anchor=True, validate_state=_VALIDATORS[torch.bfloat16],
                prepare_bucket=_FAMILY.prepare_bucket, linear=True,
                settings=_FAMILY.settings)
def bf16_compress_hook(state, bucket: ParamBucket) -> torch.futures.Future:
    """Average the parameter change since the last round, sent as bfloat16.

    Same as :func:`fp16_compress_hook` with bfloat16 on the wire: float32's range (no
    overflow risk) but 8 bits of mantissa, so error feedback matters more.

    Args:
        state: ``None``, a ``ProcessGroup`` or a :class:`HalfDeltaState`.
        bucket: the :class:`~ddp_avg_hooks.ParamBucket` to average.

    Returns:
        A future of the averaged change ``anchor - new`` in bfloat16 (the bucket is
        marked with ``mark_result_as_delta()``).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> state = dah.hooks.HalfDeltaState(error_feedback=False)
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.bf16_compress_hook, state)
        >>> handle.step(), handle.stats.bytes_sent
        (True, 20)
        >>> handle.remove(); dist.destroy_process_group()
    """
    return _half_delta_hook(state, bucket, torch.bfloat16)
