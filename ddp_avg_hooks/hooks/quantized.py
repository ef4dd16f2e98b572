"""Blockwise int8 / int4 / 2-bit averaging of the parameter *change*:
``int8_compress_hook``, ``int4_compress_hook``, ``int2_compress_hook``.

Like the half-precision hooks (:mod:`.compress`), these send the change since the last
round, ``delta = anchor - params``, never the parameters, and compute the new parameters
in the bucket's dtype. The change is quantized blockwise: per block of ``block_size``
values one float32 scale (the block's absolute maximum over ``Q``, ``Q = 127`` for int8,
``7`` for int4) and one code per value (int8; int4 as ``code + 8`` in 4 bits, two per
byte), rounded to nearest (half to even, the same on every rank). An all-zero block gets
scale 0 and codes 0, never NaN. ``int2_compress_hook``'s codes are four levels without a
zero, ``{-1.5, -0.5, 0.5, 1.5}`` times the block's root mean square, four to a byte: the
values beyond twice it are clipped, and error feedback carries what is lost (see
:mod:`ddp_avg_hooks._quantize` for the exact rule). Per bucket and
round, on rank ``r`` of ``n``::

    v_r = delta_r / n + e_r                      # e_r: error feedback (on by default)
    D_r = dequant(quant(v_r));  e_r <- v_r - D_r  # this rank's own rounding

then, with one or two ranks::

    all-gather every rank's codes and scales
    T = sum_r D_r                                # every rank, in rank order, in float32
    new = anchor - T                             # (float64 buckets: float64)

and with three ranks or more::

    all-to-all: rank j receives piece j of every rank's codes and scales
    T_j = sum_r D_r[piece j]                     # rank j, in float32 (float64 buckets: float64)
    R_j = dequant(quant(T_j));  e_j[piece j] += T_j - R_j   # the requantization's rounding
    all-gather the requantized pieces R_j
    new = anchor - R

The new values are computed in the bucket's dtype and are bit-identical on every rank.
Sums of quantized values are not quantized values, and an all-gather of every rank's
codes would hand each rank ``n - 1`` payloads; hence, from three ranks on, the
all-to-all, the sum in float32 and the requantization, instead of an allreduce of the
codes. With two ranks the all-gather moves one payload per rank, as much as the
all-to-all and the all-gather together: one collective, and no requantization. The
bucket is padded with zeros to a multiple of ``block_size`` values (``n * block_size``
from three ranks on, so that each piece is a whole number of blocks).

**Bytes.** ``stats.bytes_sent`` counts, per bucket and round, this rank's contribution:
the codes and scales of its quantized delta, ``ceil(numel * bits / 8) + 4 *
ceil(numel / block_size)`` bytes, whatever the world size. Not counted: the zero padding
(fewer than ``n * block_size`` values) and, from three ranks on, the requantized piece
each rank relays in the all-gather (``1 / n`` of the payload), just as the allreduce
hooks count the tensor they reduce once, not the ring's traffic. On the wire each rank
sends about ``2 (n - 1) / n`` times the payload (one payload with two ranks), as a ring
allreduce of it would; nothing grows with the world size. At the default
``block_size=128`` that is 0.258 (int8), 0.133 (int4) and 0.0703 (2-bit) of float32.

**Error bounds**, per element and round (tested in ``tests/test_quantized_hooks.py``).
With ``a_r`` the largest ``|v_r|`` in the element's block, ``A`` the largest ``|T|`` there,
and ``k = 1 + 2**-14`` (float32 rounding of the scale and the division):

* this rank's own rounding: ``|v_r - D_r| <= k * a_r / (2 Q)`` (int8: ``a_r / 254``,
  int4: ``a_r / 14``; 2-bit codes: half their scale, the block's root mean square, for
  the values within twice it, and less than ``a_r`` for the values clipped beyond, so
  read ``k a_r`` for ``k a_r / (2 Q)`` in the bounds below);
* the requantization, from three ranks on: ``|T - R| <= k * A / (2 Q)``;
* so one round's result is within ``sum_r k * a_r / (2 Q)`` (plus ``k * A / (2 Q)`` from
  three ranks on) of ``anchor - sum_r v_r``, plus float32 rounding of the sum ``T``
  (``(n - 1) * 2**-24 * sum_r |D_r|``) and of the new parameters to their dtype.

With ``error_feedback=False`` (``e_r = 0``) that is the error against the exact average
``anchor - mean(delta)``, and it is lost: for a persistent update direction these errors
add up linearly over rounds, ``rounds * (sum_r k a_r / (2 Q) + k A / (2 Q))`` in the
worst case. With error feedback every rounding stays in the residuals (the
requantization's on the rank that reduced the piece) and re-enters the next round's sum,
so ``sum_r e_r = sum_r v_r - R`` (``- T`` with two ranks) each round and, telescoping,
the parameters equal the exact trajectory ``anchor_0 - sum over rounds of mean(delta)``
plus ``sum_r e_r``: at any round count the error stays within one round's bound above;
only the float32 roundings of the last item add up (the parameters' own precision).

Memory per bucket, beside the anchor: the residual (``numel`` float32 values; float64
for float64 buckets) and two payload buffers (send, receive; with two ranks the receive
buffer holds both payloads; from three ranks on the send buffer is reused as the
all-gather's output and the summed piece lives in the delta's buffer).

Where the residual ``e_r`` lives:

* ``state`` is a :class:`QuantizedDeltaState`: in the state, keyed by ``bucket.index()``,
  saved by ``state_dict()`` (so ``handle.state_dict()`` checkpoints it);
* ``state`` is ``None`` or a ``ProcessGroup``: error feedback on, block size 128, the
  residual in ``bucket.memory()``, which ``handle.state_dict()`` saves.

Collective ordering: the hook issues its first collective (the all-gather with two
ranks, the all-to-all from three on), on the averaging group, from the thread that runs
rounds, and returns. With two ranks that is the whole exchange: only the dequantization
runs, in a callback. From three ranks on the reduction, the requantization and the
all-gather are deferred (``bucket.defer``) until every bucket's all-to-all is in flight,
so a round of several buckets waits for the first one while the others travel.

In a round overlapped with training (on CPU tensors) the work runs on the registration's
background thread instead, one bucket after another in launch order, and its collectives
go over the registration's private duplicate of the group (``bucket.private_group``), so
none can pair with one the training thread issues meanwhile (gloo and NCCL pair
collectives by the order each rank issues them on a group). For float32 and float64
parameters that is the whole round: the change is coded from the launch snapshot
(``bucket.change_from_snapshot``), so the training thread only takes the snapshot and
later writes the result back. Other parameters are coded on the training thread at the
launch, from their live values; from three ranks on the second phase still runs in the
background, the all-to-all on the averaging group. The codes are the same bits either
way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from .._checks import check_int
from .._groups import is_member
from ..bucket import ParamBucket
from ..collectives import add_tracked_callback, completed, tracked_then
from ..ops import QuantLayout
from ..protocol import averaging_hook
from ._delta import DeltaHookFamily, DeltaState

DEFAULT_BLOCK_SIZE = 128


def _compute_dtype(bucket: ParamBucket) -> torch.dtype:
    return torch.float64 if bucket.dtype == torch.float64 else torch.float32


def _zeros(bucket: ParamBucket) -> torch.Tensor:
    return torch.zeros(bucket.numel(), dtype=_compute_dtype(bucket), device=bucket.device)


class QuantizedDeltaState(DeltaState):
    """Options and error feedback of :func:`int8_compress_hook`, :func:`int4_compress_hook`
    and :func:`int2_compress_hook`.

    Args:
        block_size: values per float32 scale (an even int >= 2; a multiple of 4 for
            ``int2_compress_hook``). Smaller blocks follow the delta's magnitude more
            closely and cost ``4 / block_size`` bytes per value.
        error_feedback: carry the roundings (this rank's own and, from three ranks on,
            the requantization of the piece it reduced) into the next round (default
            ``True``).
        process_group: group to average over; ``None`` means the default group.

    One state per registration (a second live registration with it is refused):
    residuals are keyed by ``bucket.index()``. ``state_dict()`` holds this rank's
    residuals (they differ between ranks).

    Example:
        >>> from ddp_avg_hooks.hooks import QuantizedDeltaState
        >>> QuantizedDeltaState(block_size=64).state_dict()
        {'block_size': 64, 'error_feedback': True, 'residuals': {}}
        >>> QuantizedDeltaState(block_size=63)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: QuantizedDeltaState: block_size must be even ... got 63; try 64 or 128
    """

    __slots__ = ("block_size",)
    owner = "QuantizedDeltaState"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, error_feedback: bool = True,
                 process_group: dist.ProcessGroup | None = None) -> None:
        check_int("block_size", block_size, 2, owner=self.owner, fix="try 64 or 128")
        if block_size % 2:
            raise ValueError(
                f"{self.owner}: block_size must be even (int4 packs two codes per byte, never "
                f"across blocks), got {block_size}; try 64 or 128"
            )
        self.block_size = block_size
        super().__init__(process_group, error_feedback)

    def new_residual(self, bucket: ParamBucket) -> torch.Tensor:
        return _zeros(bucket)

    def settings(self) -> dict:
        return {"block_size": self.block_size, "error_feedback": self.error_feedback}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore residuals saved by :meth:`state_dict` (before or after the first round)."""
        saved = int(state_dict["block_size"])
        if saved != self.block_size:
            raise ValueError(
                f"{self.owner}.load_state_dict: the checkpoint has block_size={saved}, this "
                f"state {self.block_size}; use the same block_size to resume"
            )
        super().load_state_dict(state_dict)

    def __setstate__(self, s: dict) -> None:
        self.__init__(s["block_size"], s["error_feedback"])
        self.load_state_dict(s)

    def __repr__(self) -> str:
        return (f"{self.owner}(block_size={self.block_size}, error_feedback={self.error_feedback}, "
                f"process_group={self.process_group!r})")


_FAMILY = DeltaHookFamily(QuantizedDeltaState, "quant_residual", _zeros,
                          "a QuantizedDeltaState(block_size=..., error_feedback=...)")


def _two_bit_validator():
    family_check = _FAMILY.validator("int2_compress_hook")

    def validate_state(state) -> None:
        family_check(state)
        if isinstance(state, QuantizedDeltaState) and state.block_size % 4:
            raise ValueError(
                f"int2_compress_hook: block_size must be a multiple of 4 (four codes to a "
                f"byte, never across blocks), got {state.block_size}; try 64 or 128")
    return validate_state


_VALIDATORS = {8: _FAMILY.validator("int8_compress_hook"),
               4: _FAMILY.validator("int4_compress_hook"),
               2: _two_bit_validator()}


def _sub_(a: torch.Tensor, half: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out <- a - half``: the result of ``torch.sub(a, half, out=out)``, computed for a
    float32/float64 ``out`` by widening ``half`` into ``out`` first (exact), so the
    subtraction runs with one dtype (a mixed-dtype ``torch.sub`` takes a slow path on CPU)."""
    if out.dtype in (torch.float32, torch.float64) and out.data_ptr() != a.data_ptr():
        out.copy_(half)
        return torch.sub(a, out, out=out)
    return torch.sub(a, half, out=out)


def _all_gather(out: torch.Tensor, piece: torch.Tensor, group):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, piece, group=group, async_op=True)


def _codes_in_background(bucket: ParamBucket) -> bool:
    """Whether the whole round, the coding included, can run on the background thread:
    an overlapped CPU round whose change comes from the launch snapshot."""
    return bucket.defers_to_background and bucket.change_from_snapshot


def _in_background(bucket: ParamBucket, run, result: torch.futures.Future) -> None:
    """Hand ``run()`` to the background thread; its failure completes ``result``."""
    def guarded() -> None:
        try:
            run()
        except Exception as exc:
            result.set_exception(exc)

    bucket.defer(guarded, background=True)


def _gathered_round(bucket: ParamBucket, group, bits: int, block_size: int,
                    work: torch.Tensor, residual, anchor: torch.Tensor,
                    out: torch.Tensor) -> torch.futures.Future:
    """One or two ranks: every rank's codes to every rank in one all-gather, dequantized
    and added in rank order on each (no requantization). ``work``: a compute-dtype
    buffer of the bucket's size, for the change and then the sum."""
    n, numel = dist.get_world_size(group), bucket.numel()
    mine = QuantLayout.for_bucket(numel, 1, block_size, bits)  # this rank's whole delta
    gathered = mine.stacked(n)  # the ranks' payloads back to back
    send = bucket.scratch("quant_send", dtype=torch.uint8, numel=mine.total_bytes)
    recv = bucket.scratch("quant_recv", dtype=torch.uint8, numel=gathered.total_bytes)
    bucket.record_sent(mine.payload_bytes(numel))

    def code_and_gather(on_group) -> torch.futures.Future:
        bucket.quantize_delta(send, mine, scale=1.0 / n, residual=residual, out=work)
        return _all_gather(recv, send, on_group).get_future()

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()  # raises if the all-gather failed
        if out.dtype == work.dtype:  # new = anchor - T in one pass
            return ops.dequantize_blocks(recv, gathered, out, sum_pieces=True, base=anchor)
        return _sub_(anchor, ops.dequantize_blocks(recv, gathered, work, sum_pieces=True), out)

    if not _codes_in_background(bucket):
        return tracked_then(code_and_gather(group), decompress)
    result = torch.futures.Future()
    private = bucket.private_group(group)

    def complete(fut: torch.futures.Future) -> None:
        try:
            result.set_result(decompress(fut))
        except Exception as exc:
            result.set_exception(exc)

    _in_background(bucket, lambda: add_tracked_callback(code_and_gather(private), complete),
                   result)
    return result


def _quantized_delta_hook(state, bucket: ParamBucket, bits: int) -> torch.futures.Future:
    _VALIDATORS[bits](state)
    group, residual = _FAMILY.group_and_residual(state, bucket)
    if not is_member(group):
        return completed(bucket.buffer())
    block_size = state.block_size if isinstance(state, QuantizedDeltaState) else DEFAULT_BLOCK_SIZE
    n, rank, numel = dist.get_world_size(group), dist.get_rank(group), bucket.numel()
    ct = _compute_dtype(bucket)
    anchor, out = bucket.anchor(), bucket.workspace()  # every element is overwritten
    # the change and the sum are read for the last time before the result overwrites
    # the workspace
    work = out if out.dtype == ct else bucket.scratch(("delta", ct), dtype=ct)
    if n <= 2:
        return _gathered_round(bucket, group, bits, block_size, work, residual, anchor, out)
    layout = QuantLayout.for_bucket(numel, n, block_size, bits)
    # the payload buffers, reused round after round; send doubles as the all-gather's
    # output once the all-to-all has read it
    send = bucket.scratch("quant_send", dtype=torch.uint8, numel=layout.total_bytes)
    recv = bucket.scratch("quant_recv", dtype=torch.uint8, numel=layout.total_bytes)
    bucket.record_sent(layout.payload_bytes(numel))
    result = torch.futures.Future()
    # overlapped with training: the second phase on the registration's background thread,
    # its all-gather on the registration's own group, so training never waits for it;
    # from the launch snapshot, the coding and the all-to-all there too
    background = bucket.overlapped
    gather_group = bucket.private_group(group) if background else group

    def code_and_exchange(on_group):
        bucket.quantize_delta(send, layout, scale=1.0 / n, residual=residual, out=work)
        return dist.all_to_all_single(recv, send, group=on_group, async_op=True)

    def second_phase(exchange) -> None:
        # this rank's piece: sum every rank's version, requantize it into the all-gather
        # input. Only its values inside the bucket (past its end all codes are 0), in the
        # delta's buffer, which has been read by now.
        exchange.wait()
        size, start = layout.piece_bytes, rank * layout.piece_elems
        valid = min(max(numel - start, 0), layout.piece_elems)
        total = ops.dequantize_blocks(recv, layout, work[:valid], sum_pieces=True)
        mine = send[rank * size : (rank + 1) * size]
        ops.quantize_blocks(total, mine, layout.one_piece(),
                            residual_out=total if residual is not None else None)
        if residual is not None:  # total now holds T - R: the requantization's loss
            residual[start : start + valid].add_(total)
        add_tracked_callback(_all_gather(send, mine, gather_group).get_future(), decompress)

    def decompress(gathered: torch.futures.Future) -> None:
        try:
            gathered.wait()  # raises if the all-gather failed
            if out.dtype == ct:  # new = anchor - R in one pass
                value = ops.dequantize_blocks(send, layout, out, base=anchor)
            else:
                value = _sub_(anchor, ops.dequantize_blocks(send, layout, work), out)
        except Exception as exc:
            result.set_exception(exc)
        else:
            result.set_result(value)

    if _codes_in_background(bucket):
        _in_background(bucket, lambda: second_phase(code_and_exchange(gather_group)), result)
        return result
    exchange = code_and_exchange(group)

    def reduce_and_gather() -> None:
        try:
            second_phase(exchange)
        except Exception as exc:
            if not background:
                raise  # the engine names the bucket and fails the round
            result.set_exception(exc)

    bucket.defer(reduce_and_gather, background=background)
    return result


@averaging_hook(needs_anchor=True, validate_state=_VALIDATORS[8],
                prepare_bucket=_FAMILY.prepare_bucket,
                linear=True, settings=_FAMILY.settings)
def int8_compress_hook(state, bucket: ParamBucket) -> torch.futures.Future:
    """Average the parameter change since the last round, sent as blockwise int8.

    One int8 code per value and one float32 scale per ``block_size`` values (128 by
    default: 0.258 of float32's bytes). See the module docstring for the algorithm, the
    bytes counted and the error bounds; the parameters never pass through int8 and the
    new values are computed in the bucket's dtype.

    Args:
        state: ``None`` (default group) or a ``ProcessGroup``: error feedback on, block
            size 128, the residual kept in ``bucket.memory()`` (saved by
            ``handle.state_dict()``); or a :class:`QuantizedDeltaState` for options.
        bucket: the :class:`~ddp_avg_hooks.ParamBucket` to average.

    Returns:
        A future of the new flat parameters (written into ``bucket.workspace()``).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.int8_compress_hook, None, period=2)
        >>> [handle.step() for _ in range(3)], handle.stats.bytes_sent  # (10 codes + 1 scale) x 2
        ([True, False, True], 28)
        >>> handle.remove(); dist.destroy_process_group()
    """
    return _quantized_delta_hook(state, bucket, 8)


@averaging_hook(needs_anchor=True, validate_state=_VALIDATORS[4],
                prepare_bucket=_FAMILY.prepare_bucket,
                linear=True, settings=_FAMILY.settings)
def int4_compress_hook(state, bucket: ParamBucket) -> torch.futures.Future:
    """Average the parameter change since the last round, sent as blockwise int4.

    Same as :func:`int8_compress_hook` with codes in ``[-7, 7]``, two per byte (0.133 of
    float32's bytes at ``block_size=128``): a coarser rounding, so error feedback matters
    more.

    Args:
        state: ``None``, a ``ProcessGroup`` or a :class:`QuantizedDeltaState`.
        bucket: the :class:`~ddp_avg_hooks.ParamBucket` to average.

    Returns:
        A future of the new flat parameters (written into ``bucket.workspace()``).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 32))
        >>> state = dah.hooks.QuantizedDeltaState(block_size=64)
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.int4_compress_hook, state)
        >>> handle.step(), handle.stats.bytes_sent  # 2080 values: 1040 code bytes + 33 scales
        (True, 1172)
        >>> handle.remove(); dist.destroy_process_group()
    """
    return _quantized_delta_hook(state, bucket, 4)


@averaging_hook(needs_anchor=True, validate_state=_VALIDATORS[2],
                prepare_bucket=_FAMILY.prepare_bucket,
                linear=True, settings=_FAMILY.settings)
def int2_compress_hook(state, bucket: ParamBucket) -> torch.futures.Future:
    """Average the parameter change since the last round, sent as blockwise 2-bit codes.

    Same as :func:`int8_compress_hook` with four levels, ``{-1.5, -0.5, 0.5, 1.5}``
    times a float32 scale, the block's root mean square, four codes per byte (0.0703 of
    float32's bytes at ``block_size=128``, about half of int4's). The values beyond twice
    the scale are clipped: each round is coarse, and error feedback (on by default)
    carries what every rounding lost into the next. No level is zero: a value that did
    not change, in a block where others did, moves by up to half a step in a round, and
    error feedback takes it back (a block that did not change at all stays exactly as
    it was). Half of int4's bytes buy a round twice as often at the same link time:
    ``period=4`` with it sends about what ``period=8`` does with int4.

    Args:
        state: ``None``, a ``ProcessGroup`` or a :class:`QuantizedDeltaState` (its
            ``block_size`` a multiple of 4).
        bucket: the :class:`~ddp_avg_hooks.ParamBucket` to average.

    Returns:
        A future of the new flat parameters (written into ``bucket.workspace()``).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.int2_compress_hook, None, period=2)
        >>> [handle.step() for _ in range(3)], handle.stats.bytes_sent  # (3 + 4) bytes x 2
        ([True, False, True], 14)
        >>> handle.remove(); dist.destroy_process_group()
    """
    return _quantized_delta_hook(state, bucket, 2)
