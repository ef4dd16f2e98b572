"""``ParamBucket``: a flat buffer over a group of parameters, and how buckets are built.

A ``ParamBucket`` is to an averaging hook what DDP's ``GradBucket`` is to a comm hook:
the unit a hook works on. Buckets are built once, at registration, and never rebuilt.
Where a bucket's tensors live is its storage's job (:mod:`ddp_avg_hooks.storage`); what
one round knows about a bucket is a :class:`BucketRound`, made by the round engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from . import ops
from ._grad import no_grad
from .collectives import Background
from .storage import DeviceStorage

__all__ = ["BucketRound", "ParamBucket", "assign_buckets"]


class BucketRound:
    """What one round knows about one bucket.

    Made by :meth:`ParamBucket.begin_round`; the hook's calls fill it in (``buffer()``
    loads, ``mark_result_as_delta()``, ``defer()``, ``record_sent()``), the round engine
    reads it. A bucket outside any round has an idle one, which runs deferred calls at
    once.

    Attributes:
        scale: this rank's weight: the hook sees its change since the anchor scaled by it.
        overlapped: the round runs while training goes on (hooks must not wait for it).
        loaded: ``buffer()`` holds this round's values.
        result_is_delta: the hook's result is the averaged change ``anchor - new``.
        bytes_sent: bytes the hook handed to collectives.
    """

    __slots__ = ("scale", "overlapped", "loaded", "result_is_delta", "bytes_sent", "background",
                 "_deferred", "_to_background")

    def __init__(self, scale: float = 1.0, *, overlapped: bool = False, deferring: bool = False,
                 background: Background | None = None):
        self.scale, self.overlapped = scale, overlapped
        self.loaded = self.result_is_delta = False
        self.bytes_sent = 0
        #: the registration's background thread, in a round that may use it
        self.background = background
        self._deferred: list | None = [] if deferring else None
        self._to_background: list = []

    @property
    def deferring(self) -> bool:
        """Whether calls are kept for :meth:`take_deferred` (else :meth:`defer` runs them)."""
        return self._deferred is not None

    def defer(self, fn: Callable[[], None], *, background: bool = False) -> None:
        """Keep ``fn`` for :meth:`take_deferred` (or for the background thread), or run it
        at once when not deferring."""
        if background and self.background is not None and self._deferred is not None:
            self._to_background.append(fn)
        elif self._deferred is None:
            fn()
        else:
            self._deferred.append(fn)

    def take_deferred(self) -> list[Callable[[], None]]:
        """The calls deferred so far; later ones run at once."""
        deferred, self._deferred = self._deferred or [], None
        return deferred

    def take_background(self) -> list[Callable[[], None]]:
        """The calls handed to the background thread so far (see :meth:`ParamBucket.defer`)."""
        calls, self._to_background = self._to_background, []
        return calls


class ParamBucket:
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

    For hooks: the ``GradBucket`` shape (:meth:`index`, :meth:`buffer`,
    :meth:`parameters`, :meth:`is_last`, :meth:`set_buffer`) plus :meth:`numel`,
    :meth:`anchor`, :meth:`stored_anchor`, :meth:`delta`, :meth:`quantize_delta`,
    :meth:`scaled_buffer`,
    :meth:`workspace`, :meth:`scratch`, :meth:`mark_result_as_delta`,
    :meth:`mark_result_as_values`, :attr:`result_is_delta`, :meth:`defer`,
    :meth:`new_state`, :meth:`memory`, :meth:`record_sent`, :attr:`overlapped` and the
    ``device`` / ``dtype`` / ``state_device`` / ``offloaded`` attributes. For the round
    engine: :meth:`check_parameters`, :meth:`begin_round`, :meth:`apply`, :meth:`reset_anchor`,
    :meth:`launch_snapshot`, :meth:`state_dict`, :meth:`load_state_dict`,
    :meth:`layout` and :meth:`memory_tensors`.

    Args:
        index: the bucket's position among the registration's buckets.
        params: its parameters (one device and dtype, at least one).
        is_last: whether it is the registration's last bucket.
        keep_anchor: keep the parameters as of the last round (see above).
        storage: ``storage(params)`` makes the object that holds the bucket's tensors
            (:class:`~ddp_avg_hooks.storage.DeviceStorage` by default).

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

    def __init__(self, index: int, params: Sequence[torch.Tensor], *, is_last: bool,
                 keep_anchor: bool = False,
                 storage: Callable[[list[torch.Tensor]], DeviceStorage] = DeviceStorage) -> None:
        if not params:
            raise ValueError("ParamBucket needs at least one parameter")
        first = params[0]
        for p in params:
            if (p.device, p.dtype) != (first.device, first.dtype):
                raise ValueError(
                    "ParamBucket parameters must share one device and dtype; got "
                    f"{first.device}/{first.dtype} and {p.device}/{p.dtype}"
                )
        self._index, self._is_last = index, is_last
        self._storage = storage(list(params))
        self.device, self.dtype = first.device, first.dtype
        self._numel = self._storage.numel
        if keep_anchor:
            self._storage.keep_anchor()
        self._round = BucketRound()
        self._scratch: dict[object, torch.Tensor] = {}
        self._memory: dict[str, torch.Tensor] = {}
        self._launch: torch.Tensor | None = None  # parameters when an overlapped round began

    @property
    def state_device(self) -> torch.device:
        """The device where anchors and hook memory live (the parameters' device, or the
        CPU with ``offload_state=True``)."""
        return self._storage.state_device

    @property
    def offloaded(self) -> bool:
        """True when the bucket keeps its state in host memory (``offload_state=True``);
        hooks then do best to finish each bucket before the next."""
        return self._storage.offloaded

    # --- the GradBucket-shaped interface -------------------------------------------
    def index(self) -> int:
        """Position of this bucket among the registration's buckets (0-based)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """Flat 1-D tensor of this bucket's current parameters.

        Filled from the parameters on the first call of a round; after that it is the
        hook's scratch space and later calls return it as the hook left it. In a
        weighted round it holds ``anchor + scale * (params - anchor)``.
        """
        rnd = self._round
        if rnd.loaded:
            return self._storage.buffer()
        buf = self._storage.load()
        rnd.loaded = True
        if rnd.scale != 1.0:
            buf.lerp_(self.anchor(), 1.0 - rnd.scale)
        return buf

    def scaled_buffer(self, scale: float) -> torch.Tensor:
        """:meth:`buffer` filled with ``parameters * scale`` in one pass (one rounding).

        Equals ``buffer().mul_(scale)`` bit for bit only when ``scale`` is a power of two
        (as ``1 / world_size`` is for 2, 4, 8 ranks); otherwise it is one rounding
        instead of two.
        """
        if self._round.scale != 1.0:
            return self.buffer().mul_(scale)
        buf = self._storage.load(None if scale == 1.0 else scale)
        self._round.loaded = True
        return buf

    def workspace(self) -> torch.Tensor:
        """The storage of :meth:`buffer` *without* filling it, for hooks that overwrite
        every element themselves (and so can skip the copy of the parameters).

        Ask for it in every round rather than keep it: an overlapped round whose result
        is the workspace keeps that memory as the anchor, and the old anchor's memory is
        the workspace from then on (never the anchor's own)."""
        self._round.loaded = True
        return self._storage.workspace()

    def parameters(self) -> list[torch.Tensor]:
        """The parameters of this bucket, in the order they sit in :meth:`buffer`."""
        return list(self._storage.params)

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
        self._storage.buffer().copy_(tensor.reshape(-1))
        self._round.loaded = True

    # --- additions for parameter averaging -----------------------------------------
    def numel(self) -> int:
        """Number of parameter elements in this bucket."""
        return self._numel

    def has_anchor(self) -> bool:
        """Whether this bucket keeps anchors (see the class docstring)."""
        return self._storage.anchor is not None

    def _no_anchor(self) -> RuntimeError:
        return RuntimeError(
            f"bucket {self._index} keeps no anchor: mark the hook with "
            "@ddp_avg_hooks.needs_anchor or register it with keep_anchor=True"
        )

    def anchor(self) -> torch.Tensor:
        """Flat parameters as of the last averaging round, identical on every rank, on
        the parameters' device (with ``offload_state=True`` a copy kept for the round).
        Read it during a round, not across rounds: the tensor may be another one in the
        next round (see :meth:`workspace`).

        Raises ``RuntimeError`` when the hook did not ask for anchors.
        """
        anchor = self._storage.hook_anchor()
        if anchor is None:
            raise self._no_anchor()
        return anchor

    def stored_anchor(self) -> torch.Tensor:
        """The anchor where the bucket keeps it: on :attr:`state_device` (host memory
        with ``offload_state=True``). Raises ``RuntimeError`` without an anchor."""
        if self._storage.anchor is None:
            raise self._no_anchor()
        return self._storage.anchor

    @no_grad
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
            out = self.scratch(("delta", self.dtype if dtype is None else dtype),
                               dtype=self.dtype if dtype is None else dtype)
        elif dtype is not None and out.dtype != dtype:
            raise TypeError(f"delta: out has dtype {out.dtype}, dtype= asks for {dtype}")
        if not self.has_anchor():
            raise self._no_anchor()
        storage, params = self._storage, self._storage.params
        anchor, scale = storage.op_anchor(), scale * self._round.scale
        if residual is None:
            return ops.delta(anchor, params, out, scale)
        here = storage.for_op(residual)
        ops.feedback_cast(anchor, params, here, out, scale)
        storage.commit(residual, here)
        return out

    @no_grad
    def quantize_delta(self, packed: torch.Tensor, layout: ops.QuantLayout, *,
                       scale: float = 1.0, residual: torch.Tensor | None = None,
                       out: torch.Tensor | None = None) -> None:
        """Quantize ``delta(scale=scale) + residual`` blockwise into ``packed``
        (:func:`ops.quantize_blocks <ddp_avg_hooks.ops.quantize_blocks>`); ``residual``
        (``numel()`` elements of the compute dtype), when given, becomes what the rounding
        lost.

        The change is in float32 (float64 for float64 parameters). In an overlapped round
        of float32 or float64 parameters it is made from the round's launch snapshot
        block by block as the codes are, in one pass; otherwise :meth:`delta` writes it
        into ``out`` (default: a scratch buffer) first. The codes and the residual are
        the same bits either way.

        Example:
            >>> import torch
            >>> from ddp_avg_hooks import ops
            >>> from ddp_avg_hooks.bucket import ParamBucket
            >>> p = torch.nn.Parameter(torch.zeros(4))
            >>> b = ParamBucket(0, [p], is_last=True, keep_anchor=True)
            >>> with torch.no_grad():
            ...     _ = p.copy_(torch.tensor([-2.0, 0.0, 0.0, 2.0]))
            >>> layout = ops.QuantLayout.for_bucket(4, 1, 4, 8)
            >>> packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
            >>> b.quantize_delta(packed, layout, scale=0.5)  # (anchor - params) / 2
            >>> ops.dequantize_blocks(packed, layout, torch.empty(4)).tolist()
            [1.0, 0.0, 0.0, -1.0]
        """
        ct = torch.float64 if self.dtype == torch.float64 else torch.float32
        if self.change_from_snapshot:
            if not self.has_anchor():
                raise self._no_anchor()
            ops.quantize_blocks(self._storage.op_anchor(), packed, layout, residual=residual,
                                residual_out=residual, minus=self._launch,
                                scale=scale * self._round.scale)
            return
        change = self.delta(ct, scale=scale, out=out)
        ops.quantize_blocks(change, packed, layout, residual=residual, residual_out=residual)

    @property
    def change_from_snapshot(self) -> bool:
        """Whether :meth:`quantize_delta` makes this round's change from the launch
        snapshot, not the live parameters (an overlapped round of float32 or float64
        parameters): it may then run after the hook has returned, in a call the hook
        handed to the background thread (:meth:`defer`), while training goes on."""
        return (self._round.overlapped and self._launch is not None
                and self.dtype in (torch.float32, torch.float64))

    def scratch(self, key, *, dtype: torch.dtype | None = None,
                numel: int | None = None) -> torch.Tensor:
        """A flat tensor kept for this bucket under ``key`` and reused round after round
        (a hook's send buffer, say): not saved in checkpoints, counted as ``scratch`` by
        ``memory_bytes()``. Made (zeros, on the parameters' device) on first use,
        and again when ``dtype`` or ``numel`` change."""
        dtype, numel = dtype or self.dtype, self._numel if numel is None else numel
        t = self._scratch.get(key)
        if t is None or t.dtype != dtype or t.numel() != numel:
            t = self._scratch[key] = torch.zeros(numel, dtype=dtype, device=self.device)
        return t

    # --- what the hook's result is -----------------------------------------------------
    def mark_result_as_delta(self) -> None:
        """Declare that this round's future holds the averaged *change*, not new values.

        The value is then ``anchor() - new`` (any float dtype, ``numel()`` elements; a
        half-precision sum straight from a collective, say), and the round engine writes
        ``anchor() - value`` into the parameters and the anchor in one chunked pass: the
        hook needs no bucket-size buffer for its result. Call it before the hook returns;
        it holds for this round only. Raises ``RuntimeError`` without an anchor.
        """
        if not self.has_anchor():
            raise self._no_anchor()
        self._round.result_is_delta = True

    def mark_result_as_values(self) -> None:
        """Declare that this round's future holds new values (the default): for a hook
        that wraps another one whose result was a change (see :attr:`result_is_delta`)."""
        self._round.result_is_delta = False

    @property
    def result_is_delta(self) -> bool:
        """Whether this round's result has been declared a delta so far (``True`` after
        :meth:`mark_result_as_delta`); a wrapper reads it after calling the inner hook."""
        return self._round.result_is_delta

    @property
    def overlapped(self) -> bool:
        """True when this round runs while training goes on; the hook must then not wait
        for its collectives (they complete while later steps run)."""
        return self._round.overlapped

    def defer(self, fn: Callable[[], None], *, background: bool = False) -> None:
        """Run ``fn()`` once every bucket of the round has been launched (each hook
        called, the policies' exact averages started), on the same thread, in bucket
        order, before the round is waited for.

        ``background=True``, in a round that overlaps training (:attr:`overlapped`) on
        CPU tensors: ``fn`` runs on the registration's background thread instead, after
        the calls handed to it before (in launch order, the same on every rank), and the
        training thread does not wait for it. There ``fn`` may issue collectives only on
        :meth:`private_group` groups, and must complete the hook's future itself, with
        the exception if it fails. In other rounds it is an ordinary deferred call.

        For a hook's second collective, which depends on its first (reduce-scatter, then
        all-gather): the first collectives of all buckets are then in flight before any
        is waited for, and ``fn`` may issue the second one without it overtaking another
        (collectives pair by the order each rank issues them). The hook's future must
        complete once ``fn`` has run; an exception in ``fn`` fails the round (after the
        other deferred calls have run). A bucket outside a round of the engine (a hook
        called by hand) runs ``fn`` at once.
        """
        self._round.defer(fn, background=background and self.device.type == "cpu")

    @property
    def defers_to_background(self) -> bool:
        """Whether ``defer(fn, background=True)`` runs ``fn`` on the registration's
        background thread in this round (an overlapped round of the round engine, on CPU
        tensors, before the hook has returned); otherwise it is an ordinary deferred
        call."""
        rnd = self._round
        return rnd.background is not None and rnd.deferring and self.device.type == "cpu"

    def private_group(self, group):
        """The registration's own duplicate of ``group``, for collectives a background call
        issues (see :meth:`defer`); ``group`` itself outside such a round. Made at the first
        call, collective over ``group``'s members (every member asks at the same round),
        with ``group``'s timeout."""
        if not self.defers_to_background:
            return group
        return self._round.background.private(group)

    def new_state(self, dtype: torch.dtype | None = None, *,
                  numel: int | None = None) -> torch.Tensor:
        """Zeros (``numel()`` elements, the bucket's dtype unless given) where this bucket
        keeps state across rounds: ``state_device``, the parameters' device unless the
        registration keeps state in host memory (``offload_state=True``; pinned when the
        parameters are on CUDA). Hooks create their residuals with it."""
        return self._storage.new_state(dtype, numel)

    def memory(self) -> dict[str, torch.Tensor]:
        """Tensors a hook keeps across rounds for this bucket (say, an error-feedback residual).

        For hooks whose state is ``None`` or a process group and so has nowhere else to
        keep them. The handle's ``state_dict()`` saves them, per rank, and
        ``load_state_dict()`` restores them.
        """
        return self._memory

    def record_sent(self, *sent: torch.Tensor | int) -> None:
        """Count the bytes of ``sent`` (tensors, or byte counts as ``int``) as handed to a
        collective by this rank.

        Built-in hooks call this for every tensor they communicate; user hooks should
        too, so that ``handle.stats.bytes_sent`` is right.
        """
        self._round.bytes_sent += sum(t if isinstance(t, int) else t.numel() * t.element_size()
                                      for t in sent)

    # --- the round engine's side ---------------------------------------------------------
    def check_parameters(self) -> None:
        """Raise ``RuntimeError`` if a parameter was cast or moved since registration
        (its dtype, shape or device is not the bucket's any more), changing nothing."""
        self._storage.check_parameters()

    def begin_round(self, scale: float = 1.0, *, overlapped: bool = False,
                    background: Background | None = None) -> BucketRound:
        """Start a round: :meth:`buffer` is stale, ``defer`` keeps its calls, and with
        ``overlapped`` the parameters are snapshot (one copy, kept); ``background`` is the
        registration's background thread, for an overlapped round. Returns the round's
        record for this bucket.

        With ``scale`` != 1, :meth:`buffer` and :meth:`delta` show the change since the
        anchor scaled by it (this rank's weight in a weighted average); the parameters
        themselves are not touched.
        """
        if scale != 1.0 and not self.has_anchor():
            raise RuntimeError(f"bucket {self._index}: a weighted round needs an anchor")
        self._storage.end_round()
        self._round = BucketRound(scale, overlapped=overlapped, deferring=True,
                                  background=background if overlapped else None)
        if overlapped:
            if self._launch is None:
                self._launch = self._storage.empty()
            ops.flatten(self._storage.params, self._launch)
        return self._round

    def launch_snapshot(self) -> torch.Tensor | None:
        """The parameters as the last overlapped round began (``None`` before any)."""
        return self._launch

    @no_grad
    def apply(self, value: torch.Tensor, *, is_delta: bool = False, overlapped: bool = False,
              mixing: float | None = None, keep_nonnegative: bool = False) -> None:
        """Write a checked round result into the parameters in place; the anchor follows.

        ``is_delta``: ``value`` is ``anchor - new``. ``overlapped``: the round ran while
        training went on; the result is applied as ``params + (new - params_at_launch)``
        or, with ``mixing=alpha``, as ``alpha * params + (1 - alpha) * new``, and the
        anchor becomes ``new`` (identical on every rank). ``keep_nonnegative``: see
        :meth:`DeviceStorage.write_with_progress
        <ddp_avg_hooks.storage.DeviceStorage.write_with_progress>`.
        """
        storage = self._storage
        if overlapped:
            new = self._new_values(value) if is_delta else value
            storage.write_with_progress(new, self._launch, mixing, keep_nonnegative)
        elif is_delta:
            storage.write_change(value)
        else:
            storage.write(value)

    def _new_values(self, change: torch.Tensor) -> torch.Tensor:
        """``anchor - change`` in :meth:`workspace`, rounded as :meth:`apply` would."""
        out, change = self.workspace(), change.reshape(-1)
        if self.dtype == torch.float32 and change.dtype != torch.float64:
            out.copy_(change)  # exact widening, then a same-dtype subtraction
            return torch.sub(self.anchor(), out, out=out)
        ct = torch.float64 if torch.float64 in (self.dtype, change.dtype) else torch.float32
        return out.copy_(self.anchor().to(ct) - change.to(ct))

    def reset_anchor(self) -> None:
        """Make the current parameters the anchor (a no-op without anchors)."""
        self._storage.reset_anchor()

    def state_dict(self) -> dict:
        """Anchor (or ``None``) and hook memory, cloned: this bucket's part of a checkpoint."""
        anchor = self._storage.anchor
        return {"anchor": None if anchor is None else anchor.clone(),
                "memory": {k: v.clone() for k, v in self._memory.items()}}

    def check_state(self, saved: dict) -> None:
        """Raise ``ValueError`` if ``saved`` (from :meth:`state_dict`) cannot be loaded here."""
        if self.has_anchor() and saved["anchor"] is None:
            raise ValueError(
                f"load_state_dict: bucket {self._index} keeps an anchor but the checkpoint "
                "has none (was it saved by a handle without keep_anchor?)"
            )

    def load_state_dict(self, saved: dict) -> None:
        """Restore what :meth:`state_dict` saved (checked first by :meth:`check_state`)."""
        storage = self._storage
        storage.end_round()
        if storage.anchor is not None:
            storage.anchor.copy_(saved["anchor"])
        self._memory.clear()
        for key, t in saved["memory"].items():
            self._memory[key] = self.new_state(t.dtype, numel=t.numel()).view(t.shape).copy_(t)

    def layout(self) -> tuple:
        """(device type, dtype, shapes): what must agree across ranks."""
        shapes = tuple(tuple(p.shape) for p in self._storage.params)
        return (self.device.type, str(self.dtype), shapes)

    def memory_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(kind, tensor)`` for every tensor this bucket holds (see
        :mod:`ddp_avg_hooks.memory`)."""
        yield from self._storage.tensors()
        yield from (("scratch", t) for t in self._scratch.values())
        if self._launch is not None:
            yield "scratch", self._launch
        yield from (("residuals", t) for t in self._memory.values())

    def __repr__(self) -> str:
        return (
            f"ParamBucket(index={self._index}, params={len(self._storage.params)}, "
            f"numel={self._numel}, dtype={self.dtype}, device={self.device})"
        )


def assign_buckets(
    params: Iterable[torch.Tensor], bucket_cap_mb: float, *, keep_anchor: bool = False,
    storage: Callable[[list[torch.Tensor]], DeviceStorage] = DeviceStorage,
    first_index: int = 0, ends: bool = True,
) -> list[ParamBucket]:
    """Group ``params`` into buckets of one (device, dtype) and at most ``bucket_cap_mb``.

    Parameters keep their order; a parameter larger than the cap gets a bucket of its
    own. Buckets are numbered by their first parameter's position, from ``first_index``;
    the last one is ``is_last()`` when ``ends`` (the registration's last bucket).
    ``storage`` places each bucket's tensors (see :mod:`ddp_avg_hooks.storage`).

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
    return [
        ParamBucket(first_index + i, g, is_last=ends and i == len(groups) - 1,
                    keep_anchor=keep_anchor, storage=storage)
        for i, g in enumerate(groups)
    ]
