"""``ParamBucket``: a flat buffer over a group of parameters, and how buckets are built.

A ``ParamBucket`` is to an averaging hook what DDP's ``GradBucket`` is to a comm hook:
the unit a hook works on. Buckets are built once, at registration, and never rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from . import ops
from ._bucket_rounds import BucketRounds, split_like

__all__ = ["ParamBucket", "assign_buckets", "split_like"]


class ParamBucket(BucketRounds):
    """A group of parameters of one (device, dtype) and a persistent flat buffer.

    In a round, :meth:`buffer` holds the parameters (copied on first use); the hook
    returns a future of the bucket's new flat values. The buffer is scratch space owned
    by the round: a hook may overwrite it (``bucket.buffer().div_(n)``) and even return
    it; the parameters only change when the round engine writes the result back. A hook
    that writes every element itself takes :meth:`workspace` instead and skips the copy.

    Hooks that send the *change* since the last round (``anchor - params``, as the
    compressed hooks do) declare ``needs_anchor`` (:func:`ddp_avg_hooks.averaging_hook`),
    or the registration passes ``keep_anchor=True``. Anchors cost one copy of the
    parameters, so buckets of other hooks do not keep them.

    Public surface: the ``GradBucket`` shape (:meth:`index`, :meth:`buffer`,
    :meth:`parameters`, :meth:`is_last`, :meth:`set_buffer`) plus :meth:`numel`,
    :meth:`anchor`, :meth:`delta`, :meth:`workspace`, :meth:`mark_result_as_delta`,
    :meth:`memory`, :meth:`new_state`, :meth:`record_sent` and the ``device`` / ``dtype``
    / ``state_device`` attributes.
    Methods starting with ``_`` belong to the round engine. The flat buffer is allocated
    on first use, so a hook that never calls :meth:`buffer` or :meth:`workspace` (one
    that returns the averaged change, say) costs no memory for it.

    Example:
        >>> import torch
        >>> from ddp_avg_hooks.bucket import ParamBucket
        >>> ps = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(3))]
        >>> b = ParamBucket(0, ps, is_last=True, keep_anchor=True)
        >>> b.numel(), b.dtype
        (7, torch.float32)
        >>> b.buffer().tolist()
        [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
        >>> with torch.no_grad():
        ...     _ = ps[1].add_(0.5)
        >>> b.delta().tolist()
        [0.0, 0.0, 0.0, 0.0, -0.5, -0.5, -0.5]
    """

    #: True when the bucket keeps its state in host memory (``offload_state=True``); hooks
    #: then do best to finish each bucket before the next (see :mod:`ddp_avg_hooks.offload`)
    offloaded = False

    def __init__(
        self,
        index: int,
        params: Sequence[torch.Tensor],
        *,
        is_last: bool,
        keep_anchor: bool = False,
    ) -> None:
        if not params:
            raise ValueError("ParamBucket needs at least one parameter")
        first = params[0]
        for p in params:
            if (p.device, p.dtype) != (first.device, first.dtype):
                raise ValueError(
                    "ParamBucket parameters must share one device and dtype; got "
                    f"{first.device}/{first.dtype} and {p.device}/{p.dtype}"
                )
        self._index = index
        self._params = list(params)
        self._is_last = is_last
        self.device, self.dtype = first.device, first.dtype
        self.state_device = self.device  # where anchors and hook memory live
        self._numel = sum(p.numel() for p in self._params)
        self._flat: torch.Tensor | None = None  # the buffer, allocated on first use
        self._loaded = False  # whether _buffer holds this round's values
        self._delta_scale = 1.0  # this rank's weight in the round (see _start_round)
        self._result_is_delta = False  # see mark_result_as_delta
        self._overlapped = False  # whether this round overlaps training (see _start_round)
        self._anchor: torch.Tensor | None = None
        if keep_anchor:
            self._anchor = self._empty()
            self._reset_anchor()
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._memory: dict[str, torch.Tensor] = {}
        self._launch: torch.Tensor | None = None  # parameters when an overlapped round began
        self._bytes_sent = 0
        self._deferred: list | None = None  # this round's defer() calls, while the engine runs it

    def _empty(self) -> torch.Tensor:
        return torch.empty(self._numel, dtype=self.dtype, device=self.device)

    @property
    def _buffer(self) -> torch.Tensor:
        if self._flat is None:
            self._flat = self._empty()
        return self._flat

    # --- the GradBucket-shaped interface -------------------------------------------
    def index(self) -> int:
        """Position of this bucket among the registration's buckets (0-based)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """Flat 1-D tensor of this bucket's current parameters.

        Filled from the parameters on the first call of a round; after that it is the
        hook's scratch space and later calls return it as the hook left it.
        """
        if not self._loaded:
            self._load_parameters()
            if self._delta_scale != 1.0:
                self._buffer.lerp_(self.anchor(), 1.0 - self._delta_scale)
        return self._buffer

    def _scaled_buffer(self, scale: float) -> torch.Tensor:
        """:meth:`buffer` filled with ``parameters * scale`` in one pass.

        Equals ``buffer().div_(n)`` only for ``scale = 1 / n`` with ``n`` a power of two,
        which is why it is not public.
        """
        if self._delta_scale != 1.0:
            return self.buffer().mul_(scale)
        ops.flatten(self._params, self._buffer, None if scale == 1.0 else scale)
        self._loaded = True
        return self._buffer

    def workspace(self) -> torch.Tensor:
        """The storage of :meth:`buffer` *without* filling it, for hooks that overwrite
        every element themselves (and so can skip the copy of the parameters)."""
        self._loaded = True
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        """The parameters of this bucket, in the order they sit in :meth:`buffer`."""
        return list(self._params)

    def is_last(self) -> bool:
        """True for the registration's last bucket (per-round state advances here)."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (any float dtype, ``numel()`` elements) into :meth:`buffer`."""
        if tensor.numel() != self._numel:
            raise ValueError(
                f"set_buffer: bucket {self._index} has {self._numel} elements, "
                f"got a tensor with {tensor.numel()}"
            )
        self._buffer.copy_(tensor.reshape(-1))

    # --- additions for parameter averaging -----------------------------------------
    def numel(self) -> int:
        """Number of parameter elements in this bucket."""
        return self._numel

    def _has_anchor(self) -> bool:
        """Whether this bucket keeps anchors (see the class docstring)."""
        return self._anchor is not None

    def anchor(self) -> torch.Tensor:
        """Flat parameters as of the last averaging round, identical on every rank.

        Raises ``RuntimeError`` when the hook did not ask for anchors.
        """
        if self._anchor is None:
            raise RuntimeError(
                f"bucket {self._index} keeps no anchor: mark the hook with "
                "@ddp_avg_hooks.needs_anchor or register it with keep_anchor=True"
            )
        return self._anchor

    @torch.no_grad()
    def delta(self, dtype: torch.dtype | None = None, *, scale: float = 1.0,
              out: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """``(anchor() - parameters) * scale`` cast to ``dtype``, in one fused pass.

        Reads the live parameters (not :meth:`buffer`). The result lives in ``out`` if
        given (``numel()`` elements; ``bucket.workspace()`` costs no memory when the hook
        is done with the delta before it writes its result there), else in a persistent
        scratch buffer of this bucket, overwritten by the next ``delta`` call with the
        same dtype: clone it to keep it across rounds.

        ``residual`` (``numel()`` elements, any float dtype) makes it error feedback:
        the result is ``delta * scale + residual`` rounded to ``dtype``, and
        ``residual`` becomes what that rounding lost (``ops.feedback_cast``), in chunks,
        with no bucket-size temporary.
        """
        if out is None:
            dtype = self.dtype if dtype is None else dtype
            out = self._scratch.get(dtype)
            if out is None:
                out = self._scratch[dtype] = torch.empty(self._numel, dtype=dtype, device=self.device)
        elif dtype is not None and out.dtype != dtype:
            raise TypeError(f"delta: out has dtype {out.dtype}, dtype= asks for {dtype}")
        anchor, scale = self._anchor_for_op(), scale * self._delta_scale
        if residual is None:
            return ops.delta(anchor, self._params, out, scale)
        here = self._state_for_op(residual)
        ops.feedback_cast(anchor, self._params, here, out, scale)
        self._commit_state(residual, here)
        return out

    def mark_result_as_delta(self) -> None:
        """Declare that this round's future holds the averaged *change*, not new values.

        The value is then ``anchor() - new`` (any float dtype, ``numel()`` elements; a
        half-precision sum straight from a collective, say), and the round engine writes
        ``anchor() - value`` into the parameters and the anchor in one chunked pass: the
        hook needs no bucket-size buffer for its result. Call it before the hook returns;
        it holds for this round only. Raises ``RuntimeError`` without an anchor.
        """
        self.anchor()
        self._result_is_delta = True

    def defer(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` once every bucket of the round has been launched (each hook
        called, the policies' exact averages started), on the same thread, in bucket
        order, before the round is waited for.

        For a hook's second collective, which depends on its first (reduce-scatter, then
        all-gather): the first collectives of all buckets are then in flight before any
        is waited for, and ``fn`` may issue the second one without it overtaking another
        (collectives pair by the order each rank issues them). The hook's future must
        complete once ``fn`` has run; an exception in ``fn`` fails the round (after the
        other deferred calls have run). A bucket outside a round of the engine (a hook
        called by hand) runs ``fn`` at once.
        """
        if self._deferred is None:
            fn()
        else:
            self._deferred.append(fn)

    def new_state(self, dtype: torch.dtype | None = None, *, numel: int | None = None) -> torch.Tensor:
        """Zeros (``numel()`` elements, the bucket's dtype unless given) where this bucket
        keeps state across rounds: ``state_device``, the parameters' device unless the
        registration keeps state in host memory (``offload_state=True``; pinned when the
        parameters are on CUDA). Hooks create their residuals with it."""
        pin = self.state_device.type == "cpu" and self.device.type == "cuda"
        return torch.zeros(self._numel if numel is None else numel, dtype=dtype or self.dtype,
                           device=self.state_device, pin_memory=pin)

    def memory(self) -> dict[str, torch.Tensor]:
        """Tensors a hook keeps across rounds for this bucket (say, an error-feedback residual).

        For hooks whose state is ``None`` or a process group and so has nowhere else to
        keep them. The handle's ``state_dict()`` saves them, per rank, and
        ``load_state_dict()`` restores them.
        """
        return self._memory

    def record_sent(self, *tensors: torch.Tensor) -> None:
        """Count the bytes of ``tensors`` as handed to a collective by this rank.

        Built-in hooks call this for every tensor they communicate; user hooks should
        too, so that ``handle.stats.bytes_sent`` is right.
        """
        self._bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def __repr__(self) -> str:
        return (
            f"ParamBucket(index={self._index}, params={len(self._params)}, "
            f"numel={self._numel}, dtype={self.dtype}, device={self.device})"
        )


def assign_buckets(
    params: Iterable[torch.Tensor], bucket_cap_mb: float, *, keep_anchor: bool = False,
    bucket_type: type | None = None, first_index: int = 0, ends: bool = True, **bucket_kw,
) -> list[ParamBucket]:
    """Group ``params`` into buckets of one (device, dtype) and at most ``bucket_cap_mb``.

    Parameters keep their order; a parameter larger than the cap gets a bucket of its
    own. Buckets are numbered by their first parameter's position, from ``first_index``;
    the last one is ``is_last()`` when ``ends`` (the registration's last bucket).

    Example:
        >>> import torch
        >>> ps = [torch.zeros(256), torch.zeros(8, dtype=torch.bfloat16), torch.zeros(256)]
        >>> [len(b.parameters()) for b in assign_buckets(ps, bucket_cap_mb=1.5 / 1024)]
        [1, 1, 1]
        >>> [len(b.parameters()) for b in assign_buckets(ps, bucket_cap_mb=25)]
        [2, 1]
    """
    cap_bytes = bucket_cap_mb * 1024 * 1024
    groups: list[list[torch.Tensor]] = []
    open_group: dict[tuple, tuple[list[torch.Tensor], int]] = {}
    for p in params:
        key = (p.device, p.dtype)
        nbytes = p.numel() * p.element_size()
        group, size = open_group.get(key, (None, 0))
        if group is None or (size + nbytes > cap_bytes and group):
            group, size = [], 0
            groups.append(group)
        group.append(p)
        open_group[key] = (group, size + nbytes)
    make = bucket_type or ParamBucket
    return [
        make(first_index + i, g, is_last=ends and i == len(groups) - 1, keep_anchor=keep_anchor,
             **bucket_kw)
        for i, g in enumerate(groups)
    ]
