"""Where a bucket's parameters and state live: device memory, host memory, or one flat buffer.

A :class:`~ddp_avg_hooks.ParamBucket` delegates every tensor it keeps to one storage
object, chosen at registration:

* :class:`DeviceStorage` (the default): the flat buffer, the anchor and hook memory on
  the parameters' device.
* :class:`HostStorage` (``offload_state=True``): the anchor and hook memory in host
  memory, pinned when the parameters are on CUDA, copied in and out one bucket at a
  time.
* :class:`ZeroCopyStorage` (``zero_copy=True``): the parameters become views of the
  bucket's flat buffer, so an exact round runs on the parameters' own storage.

All three give the same results bit for bit (the same ops run on the same values);
they differ in what memory a round needs and where. Each keeps the dtype and device its
parameters had at registration: a round after the model is cast or moved
(``model.to(torch.float64)``) raises ``RuntimeError`` before any bucket starts, so
nothing changes (remove the handle and register again after the change).

**Host memory** (``offload_state=True``). Each op that needs the anchor or a residual
copies that bucket's part to the parameters' device, runs the same op as device
storage, and copies back what it wrote. Between rounds the device holds nothing but
the parameters; during a round the half-precision hooks run one bucket at a time (they
wait for each bucket's all-reduce and keep its result in host memory), so about two
buckets' worth (``bucket_cap_mb``) at a time. Hooks that read ``bucket.anchor()``
itself (PowerSGD, the 8/4-bit hooks, your own) get a device copy that lives until the
round is written back. The outer optimizer steps in host memory, where its parameter
lives, which for SGD's elementwise arithmetic gives the device's bits.

**Zero copy** (``zero_copy=True``). Once, at registration, the parameters are copied
into one flat tensor and each becomes a view of it (``p.data = flat[offset:offset +
p.numel()].view(p.shape)``). What changes for the user: each parameter's
``data_ptr()`` (once) and its memory format, which becomes contiguous. The
``Parameter`` objects stay the same, so the optimizer, its state and DDP keep working.
A parameter whose ``.data`` is replaced later (``p.data = t``,
``vector_to_parameters``) becomes a view again at the next round, its values copied in;
one cast or moved (``model.to(torch.float64)``) is refused then, with nothing changed.
An exact round then runs the collective on the parameters themselves: ``buffer()``
*is* the parameters, a result that is that storage is not copied back, and the bucket
keeps no model-size buffer. Hooks that write a result of their own (``workspace()``)
get a separate scratch, so they never overwrite the parameters before their result is
checked. Checks that must see a result before anything changes (``check_finite=True``)
make ``buffer()`` a copy again (``in_place=False``), so a rejected round changes
nothing. Without them, what a hook does to ``buffer()`` it does to the parameters: the
exact hook divides and all-reduces in place, so a collective that fails midway (a peer
died) leaves the buckets whose collectives had started partly reduced, as any in-place
all-reduce does; resume from a checkpoint (:mod:`ddp_avg_hooks.checkpoint`). Rounds
overlapped with training need the parameters free during a round, so ``zero_copy`` and
``overlap`` exclude each other.

Example:
    >>> import torch
    >>> from ddp_avg_hooks.storage import HostStorage, ZeroCopyStorage
    >>> host = HostStorage([torch.nn.Parameter(torch.ones(3))])
    >>> host.keep_anchor(); host.state_device, host.anchor.tolist()
    (device(type='cpu'), [1.0, 1.0, 1.0])
    >>> ps = [torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.zeros(3))]
    >>> zero = ZeroCopyStorage(ps)
    >>> ps[1].data_ptr() == zero.buffer().data_ptr() + 4 * 4  # a view of the bucket's storage
    True
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from . import ops
from ._grad import no_grad

__all__ = ["DeviceStorage", "HostStorage", "ZeroCopyStorage"]


class DeviceStorage:
    """A bucket's tensors on the parameters' device (the default placement).

    Args:
        params: the bucket's parameters (one device and dtype).

    The flat buffer is allocated on first use, so a hook that never calls
    ``buffer()`` or ``workspace()`` costs no memory for it.
    """

    #: whether anchors and hook memory live in host memory
    offloaded = False

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        first = self.params[0]
        self.device, self.dtype = first.device, first.dtype
        self.numel = sum(p.numel() for p in self.params)
        self._shapes = [p.shape for p in self.params]
        #: the anchor where it is kept (``None``: the bucket keeps none)
        self.anchor: torch.Tensor | None = None
        self._flat: torch.Tensor | None = None

    @property
    def state_device(self) -> torch.device:
        """Where anchors and hook memory live."""
        return self.device

    def check_parameters(self) -> None:
        """Raise ``RuntimeError`` if a parameter is no longer of the dtype, shape and
        device it had at registration (the model was cast or moved since, e.g.
        ``model.to(torch.float64)``): the bucket's buffers cannot hold it without
        rounding or copying it elsewhere. Runs as each round begins, before any bucket
        starts, so a refused round changes nothing."""
        for p, shape in zip(self.params, self._shapes):
            if (p.dtype, p.shape, p.device) != (self.dtype, shape, self.device):
                raise RuntimeError(_changed_parameter(p, shape, self.dtype, self.device))

    def empty(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised flat tensor of the bucket's size on the parameters' device."""
        return torch.empty(self.numel, dtype=dtype or self.dtype, device=self.device)

    # --- the round's flat buffers --------------------------------------------------------
    def buffer(self) -> torch.Tensor:
        """The flat buffer a round's values are built in."""
        if self._flat is None:
            self._flat = self.empty()
        return self._flat

    def load(self, scale: float | None = None) -> torch.Tensor:
        """:meth:`buffer` filled with the parameters (times ``scale``, in one pass)."""
        return ops.flatten(self.params, self.buffer(), scale)

    def workspace(self) -> torch.Tensor:
        """A flat tensor a hook may overwrite entirely with its result."""
        return self.buffer()

    # --- the anchor and hook memory ------------------------------------------------------
    def keep_anchor(self) -> None:
        """Allocate the anchor and make it the current parameters."""
        self.anchor = self.new_state()
        self.reset_anchor()

    def reset_anchor(self) -> None:
        """Make the current parameters the anchor (a no-op without one)."""
        if self.anchor is not None:
            ops.flatten(self.params, self.anchor)

    def hook_anchor(self) -> torch.Tensor | None:
        """The anchor on the parameters' device, as a hook reads it during a round."""
        return self.anchor

    def op_anchor(self) -> torch.Tensor:
        """The anchor where an op on the parameters' device can read and write it."""
        return self.anchor

    def for_op(self, stored: torch.Tensor) -> torch.Tensor:
        """``stored`` (anchor or hook memory) where an op on the parameters' device can use it."""
        return stored

    def commit(self, stored: torch.Tensor, used: torch.Tensor) -> None:
        """Keep in ``stored`` what an op wrote into ``used`` (from :meth:`for_op`)."""

    def new_state(self, dtype: torch.dtype | None = None, numel: int | None = None) -> torch.Tensor:
        """Zeros where this storage keeps state across rounds (:attr:`state_device`)."""
        pin = self.state_device.type == "cpu" and self.device.type == "cuda"
        return torch.zeros(self.numel if numel is None else numel, dtype=dtype or self.dtype,
                           device=self.state_device, pin_memory=pin)

    # --- writing a round's result --------------------------------------------------------
    @no_grad
    def write(self, values: torch.Tensor) -> None:
        """``params <- values`` in place; the anchor (if kept) takes the same values."""
        ops.apply_(values, self.params, self.anchor)

    @no_grad
    def write_change(self, change: torch.Tensor) -> None:
        """``params <- anchor - change`` in place, and the anchor follows (chunked)."""
        anchor = self.op_anchor()
        ops.apply_delta_(anchor, self.on_device(change), self.params)
        self.commit(self.anchor, anchor)
        self.end_round()

    @no_grad
    def write_with_progress(self, values: torch.Tensor, launch: torch.Tensor,
                            mixing: float | None, keep_nonnegative: bool = False) -> None:
        """Apply an overlapped round; the anchor becomes ``values``.

        ``mixing=None``: ``params <- params + (values - launch)``, keeping the local
        progress made since the round began (``launch``: the parameters then; it may be
        overwritten). ``mixing=alpha``: ``params <- alpha * params + (1 - alpha) * values``.
        ``keep_nonnegative`` (``mixing=None``): a tensor that held no negative value at
        launch (a second moment, a running variance) is kept no lower than the smaller of
        its value and its new value, since its progress can be a decay larger than the
        average's gain; ``values`` serves as scratch for it.
        """
        values = self.on_device(values)
        if (mixing is None and not keep_nonnegative and self.anchor is not None
                and self.anchor.device == values.device):
            if self._owns(values):  # the round's workspace becomes the anchor: no copy
                ops.apply_progress_(values, launch, self.params)
                self._swap_with_anchor()
            else:
                ops.apply_progress_(values, launch, self.params, self.anchor)  # one pass
            self.end_round()
            return
        if self.anchor is not None:
            self.anchor.copy_(values)
        if mixing is not None:
            torch._foreach_lerp_(self.params, ops.split_like(values, self.params), 1.0 - mixing)
        else:
            held = (_nonnegative(ops.split_like(launch, self.params),
                                 host=_decides_on_host(launch.device))
                    if keep_nonnegative else [])
            correction = launch.neg_().add_(values)
            floors = ops.split_like(values, self.params) if held else []
            for i, flag in held:
                torch.minimum(self.params[i], floors[i], out=floors[i])
                if flag is not None:  # no floor where the tensor held a negative value
                    floors[i].masked_fill_(flag.logical_not(), float("-inf"))
            torch._foreach_add_(self.params, ops.split_like(correction, self.params))
            for i, _ in held:
                torch.maximum(self.params[i], floors[i], out=self.params[i])
        self.end_round()

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        """A flat result where the parameters are (an outer optimizer may step elsewhere)."""
        return t.reshape(-1)

    def _owns(self, values: torch.Tensor) -> bool:
        """Whether ``values`` is this storage's :meth:`workspace` (all of it), in the
        anchor's dtype and memory: it may then become the anchor, the old anchor the
        next workspace."""
        return not self.offloaded and _is_whole(values, self._flat, self.anchor)

    def _swap_with_anchor(self) -> None:
        """Keep the workspace as the anchor; the old anchor is the workspace now (every
        hook that takes it overwrites it)."""
        self._flat, self.anchor = self.anchor, self._flat

    def end_round(self) -> None:
        """Drop what the round kept on the device for this bucket."""

    # --- accounting ----------------------------------------------------------------------
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(kind, tensor)`` for every tensor this storage holds (see
        :mod:`ddp_avg_hooks.memory`)."""
        if self._flat is not None:
            yield "bucket_buffers", self._flat
        if self.anchor is not None:
            yield "anchors", self.anchor


class HostStorage(DeviceStorage):
    """Anchors and hook memory in host memory (``offload_state=True``; see the module)."""

    offloaded = True

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        super().__init__(params)
        self._staged: torch.Tensor | None = None  # the anchor on the device, for this round

    @property
    def state_device(self) -> torch.device:
        return torch.device("cpu")

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        # a fresh copy even when the state already is on the parameters' device (a CPU
        # run), so the copies in and out are the same code on every device
        return t.to(self.device, non_blocking=t.is_pinned(), copy=True)

    @no_grad
    def reset_anchor(self) -> None:
        # parameter by parameter into views of the host anchor: no device copy of the bucket
        if self.anchor is not None:
            for a, p in zip(ops.split_like(self.anchor, self.params), self.params):
                a.copy_(p)

    def hook_anchor(self) -> torch.Tensor | None:
        """A device copy of the anchor, made at the first call of a round and kept until
        the round is written back."""
        if self.anchor is None:
            return None
        if self._staged is None:
            self._staged = self._to_device(self.anchor)
        return self._staged

    def op_anchor(self) -> torch.Tensor:
        return self._staged if self._staged is not None else self._to_device(self.anchor)

    def for_op(self, stored: torch.Tensor) -> torch.Tensor:
        return self._to_device(stored) if stored.device == self.state_device else stored

    def commit(self, stored: torch.Tensor, used: torch.Tensor) -> None:
        if used is not stored:
            stored.copy_(used)

    @no_grad
    def write(self, values: torch.Tensor) -> None:
        ops.apply_(self.on_device(values), self.params)
        self.reset_anchor()
        self.end_round()

    def on_device(self, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1)
        return t if t.device == self.device else self._to_device(t)

    def end_round(self) -> None:
        self._staged = None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from super().tensors()
        if self._staged is not None:  # only during a round
            yield "scratch", self._staged


class ZeroCopyStorage(DeviceStorage):
    """The parameters as views of the bucket's flat buffer (``zero_copy=True``; see the module).

    Args:
        params: the bucket's parameters; each becomes a view of the flat buffer, once.
        in_place: rounds work on the parameters' storage (``False``: ``buffer()`` is a
            copy, for checks that must see a result before it is written).
    """

    def __init__(self, params: Sequence[torch.Tensor], in_place: bool = True) -> None:
        super().__init__(params)
        flat = self.empty()
        with torch.no_grad():
            ops.flatten(self.params, flat)
            self._views = ops.split_like(flat, self.params)
            for p, view in zip(self.params, self._views):
                p.data = view
        self._flat = flat  # the parameters' storage
        self.in_place = in_place
        self._copy: torch.Tensor | None = None  # buffer() when not in place
        self._work: torch.Tensor | None = None  # workspace(): never the parameters

    @no_grad
    def _follow_parameters(self) -> None:
        """Make every parameter a view of the flat buffer again, where its ``.data`` was
        replaced since registration (``p.data = t``, ``vector_to_parameters``, ``.to()``
        of the model), its values copied into the buffer, so that a round averages what
        the model holds. A replacement of another dtype, shape or device cannot live in
        the buffer: ``RuntimeError``, nothing changed. Runs as each round begins."""
        for p, view in self._moved():
            view.copy_(p.data)
            p.data = view

    def _moved(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(parameter, its view)`` of the parameters that are views no more; raises
        for one that cannot become one again."""
        moved = [(p, view) for p, view in zip(self.params, self._views)
                 if p.data_ptr() != view.data_ptr()]
        for p, view in moved:
            if (p.dtype, p.shape, p.device) != (view.dtype, view.shape, view.device):
                raise RuntimeError("zero_copy: " + _changed_parameter(
                    p, view.shape, view.dtype, view.device))
        return moved

    def check_parameters(self) -> None:
        self._moved()

    def buffer(self) -> torch.Tensor:
        if self.in_place:
            return self._flat
        if self._copy is None:
            self._copy = torch.empty_like(self._flat)
        return self._copy

    def load(self, scale: float | None = None) -> torch.Tensor:
        self._follow_parameters()
        out = self.buffer()
        if not self.in_place:
            out.copy_(self._flat)
        return out if scale is None else out.mul_(scale)

    def workspace(self) -> torch.Tensor:
        self._follow_parameters()
        if self._work is None:
            self._work = torch.empty_like(self._flat)
        return self._work

    def keep_anchor(self) -> None:
        self._follow_parameters()
        self.anchor = self._flat.clone()

    def _owns(self, values: torch.Tensor) -> bool:
        # the flat buffer is the parameters themselves: only the workspace may be swapped
        return _is_whole(values, self._work, self.anchor)

    def _swap_with_anchor(self) -> None:
        self._work, self.anchor = self.anchor, self._work

    @no_grad
    def write(self, values: torch.Tensor) -> None:
        moved = self._moved()  # replaced during the round: they take its values too
        values = values.reshape(-1)
        if values.data_ptr() != self._flat.data_ptr():
            self._flat.copy_(values)
        for p, view in moved:
            p.data = view
        if self.anchor is not None:
            self.anchor.copy_(self._flat)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        # the flat buffer is the parameters: only the scratch a hook asked for counts
        yield from (("scratch", t) for t in (self._copy, self._work) if t is not None)
        if self.anchor is not None:
            yield "anchors", self.anchor


def _is_whole(values: torch.Tensor, buffer: torch.Tensor | None, anchor: torch.Tensor) -> bool:
    """Whether ``values`` is all of ``buffer`` (a flat view of it, from its first element),
    with the anchor's dtype, device and size."""
    return (buffer is not None and values.data_ptr() == buffer.data_ptr()
            and values.numel() == buffer.numel() == anchor.numel()
            and values.dtype == buffer.dtype == anchor.dtype
            and values.device == anchor.device and values.is_contiguous())


def _changed_parameter(p: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                      device: torch.device) -> str:
    """What to tell a user whose parameter ``p`` is no longer the ``dtype`` ``shape`` on
    ``device`` it was at registration."""
    return (f"a parameter of shape {tuple(shape)} is now {p.dtype} {tuple(p.shape)} on "
            f"{p.device}, not the {dtype} on {device} it was at registration (the model "
            "was moved or cast, e.g. model.to(torch.float64) or .half()); the rounds "
            "cannot average it as it is now. Change the model before registering, or "
            "handle.remove() and register again after the change")


def _decides_on_host(device: torch.device) -> bool:
    """Whether a value needed to pick a write's path is read on the host (CPU tensors:
    no queue to stall) or stays on the device (an accelerator)."""
    return device.type == "cpu"


def _nonnegative(tensors: Sequence[torch.Tensor], *, host: bool
                 ) -> list[tuple[int, torch.Tensor | None]]:
    """``(index, flag)`` for the ``tensors`` that may hold no negative value.

    ``host``: decided on the host, with one sync for all of them: only those that hold
    none, with ``flag=None``. Otherwise (an accelerator, where a sync would stall the
    training thread behind the queued work) every non-empty tensor, with a 0-dim bool
    ``flag`` on its device saying whether it holds none.
    """
    if not tensors:
        return []
    if not host:
        return [(i, t.amin().ge(0)) for i, t in enumerate(tensors) if t.numel()]
    mins = [t.min() if t.numel() else t.new_zeros(()) for t in tensors]
    return [(i, None) for i, ok in enumerate(torch.stack(mins).ge(0).tolist()) if ok]
