"""PowerSGD on parameter deltas: ``PowerSGDState`` and ``powersgd_hook``.

PowerSGD (Vogels et al., 2019) sends a rank-``r`` approximation of each matrix
instead of the matrix. Here the matrix is the change of a parameter since the last
round, ``delta = anchor - params`` (scaled by ``1 / world_size``), so one round costs
``r * (n + m)`` numbers per ``n x m`` matrix instead of ``n * m``. Per bucket and round:

1. ``C_w = delta_w / world_size + E_w`` on each rank ``w`` (``E_w``: error feedback).
   Matrix-shaped parameters are viewed as ``(shape[0], -1)`` (conv weights: ``(out, -1)``).
2. ``P = allreduce_sum(C_w Q)`` for every compressed matrix, in **one** collective
   together with the exact tensors (``sum_w C_w`` of 1-D, 0-dim and too-small tensors).
3. ``P <- orthonormalize(P)``: ``P / (||P|| + orthogonalization_epsilon)`` at rank 1,
   Householder QR (``torch.linalg.qr``, never divides) at rank >= 2.
4. ``Q = allreduce_sum(C_w^T P)`` for every compressed matrix: the **second** and last
   collective.
5. ``new = anchor - P Q^T`` (the approximation of ``sum_w C_w``), ``anchor - sum_w C_w``
   for the exact tensors, in the bucket's dtype. ``E_w <- C_w - P (C_w^T P)^T``: what
   this rank's own contribution lost to the projection (Vogels et al., Algorithm 2).
6. ``Q`` is kept for the next round (warm start).

Properties (tested in ``tests/test_powersgd.py``):

* at full rank (``matrix_approximation_rank >= min(n, m)``, ``min_compression_rate=0``)
  ``P P^T`` is the identity on the columns of ``sum_w C_w``: the result equals the
  exact average up to float32 rounding;
* ``P`` and ``Q`` are identical on every rank after the allreduces, so every rank
  writes bit-identical parameters (on equal thread counts);
* an all-zero delta gives ``P = 0``, ``Q = 0``, no NaN, and unchanged parameters; a
  warm-started ``Q`` that became all zero is re-drawn from ``seed``;
* ``Q`` is drawn from ``torch.Generator`` seeded with ``(seed, bucket.index())``, on the
  CPU, identically on every rank; the global RNG is never touched.

On an FSDP2 model a bucket holds a rank's local shards: each matrix is the rank's
row-block of the parameter (``Shard(0)``), compressed on its own, with its own factors and
error feedback. So the rank-``r`` approximation is per block (the whole matrix's may reach
rank ``r * shards``), and a block of at most ``r`` rows is averaged exactly. The ranks that
average together hold the same blocks, so their factors agree as on DDP.

Collective ordering: both allreduces are issued by the caller's thread, in the hook
itself; the hook waits for the ``P`` allreduce (small) before issuing ``Q``, and only
the decompression runs in a ``.then`` callback. A collective issued from a callback
thread could overtake another collective issued meanwhile on the same group (the next
bucket, buffer averaging, a training step of an overlapped round), in a different
order on each rank: gloo and NCCL pair collectives by the order each rank issues them.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
import torch.distributed as dist

from .._checks import check_bool, check_int
from .._groups import check_group, is_member, or_world
from ..bucket import ParamBucket
from ..collectives import completed, tracked_then
from ..protocol import averaging_hook
from ._per_bucket import PerBucket
from ._powersgd_memory import BucketMemory, load_bucket, save_bucket

_OWNER = "PowerSGDState"


class PowerSGDState:
    """Options and per-bucket memory of :func:`powersgd_hook`.

    Args:
        process_group: group to average over; ``None`` means the default group.
        matrix_approximation_rank: rank ``r`` of the approximation (capped at
            ``min(n, m)`` per matrix). Higher: more accurate and more bytes. A delta
            of several steps is much less low-rank than one gradient, above all with
            adaptive optimizers (AdamW's updates are close to full rank): ranks that
            suit gradients (1-4) leave most of the delta to error feedback and the
            replicas drift; start from 16-32 (``benchmarks/study_powersgd.py`` measures
            what each rank keeps of your model's deltas).
        start_powersgd_round: averaging rounds before this one are exact (an allreduce
            of the delta); compression starts here. Unlike DDP's PowerSGD, 0 is fine:
            our buckets are never rebuilt. The state counts a round when the model's last
            bucket averages: with ``fragments=K``, once per period (the K fragments'
            rounds of one period share a number, here and for ``warm_start=False``).
        min_compression_rate: compress an ``n x m`` matrix only if
            ``n * m > min_compression_rate * r * (n + m)``; others, 1-D and 0-dim tensors
            are averaged exactly. ``0`` compresses every matrix.
        use_error_feedback: carry what compression lost into the next round.
        warm_start: start each round's power iteration from the last round's ``Q``
            (else re-draw ``Q`` from ``seed`` every round).
        orthogonalization_epsilon: added to the norm in the rank-1 normalisation so an
            all-zero factor gives zeros, not NaN (rank >= 2 uses QR, which never divides).
            Must be > 0; far below any norm that matters by default.
        seed: seed of the ``Q`` draws; every rank must use the same one.

    One state per registration (a second live registration with it is refused):
    memory is keyed by ``bucket.index()``. ``round`` counts averaging rounds (it
    advances on the last bucket). ``state_dict()`` holds the round, this rank's error
    feedback and ``Q`` of every bucket.

    Example:
        >>> from ddp_avg_hooks.hooks import PowerSGDState
        >>> PowerSGDState(matrix_approximation_rank=4).round
        0
        >>> PowerSGDState(orthogonalization_epsilon=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: PowerSGDState: orthogonalization_epsilon must be > 0 (an all-zero delta ...
    """

    __slots__ = (
        # often tuned
        "process_group",
        "matrix_approximation_rank",
        "start_powersgd_round",
        "min_compression_rate",
        # seldom tuned
        "use_error_feedback",
        "warm_start",
        "orthogonalization_epsilon",
        "seed",
        # internal state
        "round",
        "_memory",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powersgd_round: int = 0,
        min_compression_rate: float = 2.0,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 1e-30,
        seed: int = 0,
    ) -> None:
        check_group(process_group, _OWNER)
        check_int("matrix_approximation_rank", matrix_approximation_rank, 1, owner=_OWNER,
                  fix="rank 1 sends the least; try 1 to 4")
        check_int("start_powersgd_round", start_powersgd_round, 0, owner=_OWNER,
                  fix="0 compresses from the first round")
        if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, Real):
            raise TypeError(
                "PowerSGDState: min_compression_rate must be a number, got "
                f"{type(min_compression_rate).__name__}"
            )
        if not (min_compression_rate >= 0 and math.isfinite(min_compression_rate)):
            raise ValueError(
                f"PowerSGDState: min_compression_rate must be finite and >= 0, got "
                f"{min_compression_rate}; 0 compresses every matrix, 2.0 is the default"
            )
        check_bool("use_error_feedback", use_error_feedback, owner=_OWNER)
        check_bool("warm_start", warm_start, owner=_OWNER)
        epsilon = orthogonalization_epsilon
        if isinstance(epsilon, bool) or not isinstance(epsilon, Real):
            raise TypeError(
                "PowerSGDState: orthogonalization_epsilon must be a number, got "
                f"{type(orthogonalization_epsilon).__name__}"
            )
        if not (orthogonalization_epsilon > 0 and math.isfinite(orthogonalization_epsilon)):
            raise ValueError(
                "PowerSGDState: orthogonalization_epsilon must be > 0 (an all-zero delta "
                "would divide 0 by 0); leave the default (1e-30) or pass e.g. 1e-8"
            )
        check_int("seed", seed, 0, owner=_OWNER,
                  fix="pass the same non-negative seed on every rank")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powersgd_round = start_powersgd_round
        self.min_compression_rate = float(min_compression_rate)
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.seed = seed
        self.round = 0
        self._memory: PerBucket[BucketMemory] = PerBucket(
            _OWNER, create=lambda bucket: BucketMemory(self, bucket), save=save_bucket,
            load=load_bucket, numel=lambda mem: mem.numel)

    # --- randomness ---------------------------------------------------------------------
    def draw_q(self, numel: int, bucket_index: int, round_: int | None, dtype,
                device) -> torch.Tensor:
        """Standard-normal ``Q`` factors of a bucket, the same on every rank."""
        draw = 0 if round_ is None else round_ + 1
        key = (self.seed * 1_000_003 + bucket_index) * 1_000_003 + draw
        gen = torch.Generator(device="cpu")
        gen.manual_seed(key % (2**63))
        return torch.randn(numel, generator=gen, dtype=dtype).to(device)

    def bucket_memory(self, bucket: ParamBucket) -> BucketMemory:
        """``bucket``'s factors, warm-start ``Q`` and error feedback (made on first use)."""
        return self._memory.get(bucket)

    def memory_of(self, index: int) -> BucketMemory:
        """The memory of the bucket with ``index`` (``KeyError`` before its first use)."""
        return self._memory[index]

    # --- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The round counter, this rank's error feedback and ``Q`` per bucket index."""
        return {
            "round": self.round,
            "matrix_approximation_rank": self.matrix_approximation_rank,
            "buckets": self._memory.state_dict(),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what :meth:`state_dict` saved (before or after the first round)."""
        saved_rank = state_dict["matrix_approximation_rank"]
        if saved_rank != self.matrix_approximation_rank:
            raise ValueError(
                f"PowerSGDState.load_state_dict: the checkpoint has matrix_approximation_rank="
                f"{saved_rank}, this state {self.matrix_approximation_rank}; use the same rank"
            )
        self.round = int(state_dict["round"])
        self._memory.load_state_dict(state_dict["buckets"])

    def settings(self) -> dict:
        """The options every rank must share (all but the process group)."""
        return {k: getattr(self, k) for k in self.__slots__[1:8]}

    def __getstate__(self) -> dict:  # process groups do not pickle
        return {"options": self.settings(), "state": self.state_dict()}

    def __setstate__(self, s: dict) -> None:
        self.__init__(None, **s["options"])
        self.load_state_dict(s["state"])

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__[:8])
        return f"PowerSGDState({opts}, round={self.round})"


def _orthonormalize_rows_(pt: torch.Tensor, epsilon: float) -> None:
    """Orthonormal rows of ``pt`` (r x n, r <= n; the columns of P), in place."""
    if pt.shape[0] == 1:
        pt.div_(torch.linalg.vector_norm(pt).add_(epsilon))
    else:
        pt.copy_(torch.linalg.qr(pt.t()).Q.t())


def _validate_state(state) -> None:
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            "powersgd_hook: state must be a PowerSGDState, e.g. "
            "PowerSGDState(process_group=None, matrix_approximation_rank=4), "
            f"got {type(state).__name__}"
        )


def _prepare_bucket(state: PowerSGDState, bucket: ParamBucket) -> None:
    """Create the bucket's memory at registration (a fresh handle's ``state_dict()``
    then has the structure a checkpoint loads into, as torch.distributed.checkpoint needs)."""
    state.bucket_memory(bucket)


def _settings(state: PowerSGDState) -> dict:
    return state.settings()


@averaging_hook(needs_anchor=True, validate_state=_validate_state, prepare_bucket=_prepare_bucket,
                linear=True, settings=_settings)
def powersgd_hook(state: PowerSGDState, bucket: ParamBucket) -> torch.futures.Future:
    """Average the parameter change with PowerSGD (low rank, error feedback, warm start).

    See the module docstring for the algorithm and its guarantees. 1-D, 0-dim and
    matrices below ``min_compression_rate`` are averaged exactly; each bucket costs
    at most two allreduces per round, ``4 * (sum r (n + m) + exact numel)`` bytes in
    float32 (float64 buckets: 8 bytes per number). The hook returns after the first
    (``P``) allreduce has completed (on gloo the host waits for it; with NCCL only the
    stream does), so both collectives are issued by the caller's thread; the returned
    future covers the ``Q`` allreduce and the decompression.

    Args:
        state: a :class:`PowerSGDState` (one per registration).
        bucket: the :class:`~ddp_avg_hooks.ParamBucket` to average.

    Returns:
        A future of the new flat parameters (written into ``bucket.workspace()``).

    Example:
        >>> import torch, torch.distributed as dist
        >>> import ddp_avg_hooks as dah
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 32))
        >>> state = dah.hooks.PowerSGDState(matrix_approximation_rank=2)
        >>> handle = dah.register_averaging_hook(ddp, dah.hooks.powersgd_hook, state)
        >>> handle.step(), handle.stats.bytes_sent  # 4 bytes x (2 x (32 + 64) + 32 bias)
        (True, 896)
        >>> state.round
        1
        >>> handle.remove(); dist.destroy_process_group()
    """
    _validate_state(state)
    group = or_world(state.process_group)
    if not is_member(group):
        return completed(bucket.buffer())
    round_ = state.round
    if bucket.is_last():
        state.round += 1
    mem = state.bucket_memory(bucket)
    layout = mem.layout
    anchor, out = bucket.anchor(), bucket.workspace()  # every element is overwritten
    # C lives in the workspace when the dtypes agree: each part of it is read for the
    # last time before the result overwrites that part
    c = bucket.delta(mem.p.dtype, scale=1.0 / dist.get_world_size(group),
                     out=out if out.dtype == mem.p.dtype else None)
    if mem.residual is not None:
        c.add_(mem.residual)

    if round_ < state.start_powersgd_round or not layout.matrices:
        # Exact round: one allreduce of the (error-corrected) delta.
        if mem.residual is not None:
            mem.residual.zero_()
        bucket.record_sent(c)
        fut = dist.all_reduce(c, group=group, async_op=True).get_future()
        return tracked_then(fut, lambda f: torch.sub(anchor, f.value()[0], out=out))

    p_all, q_all = mem.p, mem.q
    if not state.warm_start:
        q_all.copy_(state.draw_q(layout.q_numel, bucket.index(), round_, q_all.dtype,
                                 q_all.device))
    views = []
    for off, n, m, r, p_off, q_off in layout.matrices:
        ci = c[off : off + n * m].view(n, m)
        # factors are stored transposed, P^T (r x n) and Q^T (r x m): for small r, BLAS
        # runs these products much faster than with n x r / m x r row-major factors
        pt = p_all[p_off : p_off + n * r].view(r, n)
        qt = q_all[q_off : q_off + m * r].view(r, m)
        if state.warm_start:  # a Q that collapsed to zero (zero delta) would stay zero
            qt.copy_(torch.where(qt.eq(0).all(), mem.q_init[q_off : q_off + m * r].view(r, m), qt))
        torch.mm(qt, ci.t(), out=pt)  # P^T = Q^T C^T
        views.append((off, n, m, ci, pt, qt, q_off))
    tail = p_all[p_all.numel() - layout.exact_numel :]
    t_off = 0
    for off, length in layout.exact_runs:
        tail[t_off : t_off + length].copy_(c[off : off + length])
        t_off += length
    bucket.record_sent(p_all, q_all)

    # Wait for P here rather than issue Q from a callback thread (see "Collective
    # ordering" above). With NCCL, wait() only orders the stream; the host goes on.
    dist.all_reduce(p_all, group=group, async_op=True).wait()
    for _, _, _, ci, pt, qt, _ in views:
        _orthonormalize_rows_(pt, state.orthogonalization_epsilon)
        torch.mm(pt, ci, out=qt)  # Q^T = P^T C
    if mem.q_local is not None:
        mem.q_local.copy_(q_all)

    def finish(_fut: torch.futures.Future) -> torch.Tensor:
        for off, n, m, ci, pt, qt, q_off in views:
            if mem.residual is not None:  # E = C - P (C^T P)^T: this rank's projection loss
                qlt = mem.q_local[q_off : q_off + qt.numel()].view(qt.shape)
                residual = mem.residual[off : off + n * m].view(n, m)
                torch.addmm(ci, pt.t(), qlt, alpha=-1, out=residual)
            oi, ai = out[off : off + n * m].view(n, m), anchor[off : off + n * m].view(n, m)
            if oi.dtype == pt.dtype:  # may overwrite ci: it is not read again
                torch.addmm(ai, pt.t(), qt, alpha=-1, out=oi)  # anchor - P Q^T
            else:
                torch.sub(ai, pt.t() @ qt, out=oi)
        t = 0
        for off, length in layout.exact_runs:
            torch.sub(anchor[off : off + length], tail[t : t + length], out=out[off : off + length])
            t += length
        return out

    return tracked_then(dist.all_reduce(q_all, group=group, async_op=True).get_future(), finish)
