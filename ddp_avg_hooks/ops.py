"""Fused bucket copies: flatten, unflatten, delta and apply, with casting.

Two more ops serve hooks that keep no bucket-size float buffer: :func:`feedback_cast`
(the error-feedback rounding of the change) and :func:`apply_delta_` (write a round's
averaged change); :func:`apply_progress_` writes an overlapped round in one pass.
Outside the extension they run in bounded chunks (no temporary the size of the
bucket); the extension takes them when the anchor has the parameters' dtype.

Rules every implementation follows, bit for bit:

* A flat buffer holds the parameters back to back, each in its *logical* (row-major)
  order, whatever its memory format: ``flat[off:off + p.numel()].view(p.shape)``.
* Arithmetic runs in float32 (float64 when any tensor of the parameter's computation
  is float64) and the result is rounded once to the output dtype, to nearest-even,
  as ``Tensor.to`` does.
* Supported dtypes: float32, float16, bfloat16, float64. All tensors on one device.

This module is the only one that knows where the ops come from. Each call is
validated once, here (``ValueError`` for sizes, layout and devices, ``TypeError`` for
dtypes), then routed, as ``torch.optim`` picks fused / foreach / for-loop kernels:

* ``"extension"``: the C++ extension, when it is loaded and every tensor is float32,
  float16 or bfloat16 on the CPU, or on CUDA when the extension was built with CUDA;
* ``"foreach"``: ``torch._foreach_*`` ops (float64, other foreach-capable devices, or
  no extension);
* ``"reference"``: a per-tensor loop in plain PyTorch (tensor subclasses, devices
  without foreach kernels), the readable definition of each op.

All three give identical results. The blockwise quantization ops
(:func:`quantize_blocks`, :func:`dequantize_blocks`, over a :class:`QuantLayout`) run in
the extension for float32 and in plain PyTorch (also float64) otherwise, with the same
bits. :func:`backend` says whether the extension is in use. It is loaded (built the
first time, about a minute; ``make ext`` does it ahead) on the first op call or
``backend()``, never at import; ``DDP_AVG_HOOKS_DISABLE_EXT=1`` keeps it out. CPU calls
of the extension use ``torch.get_num_threads()`` threads.

Example:
    >>> import torch
    >>> from ddp_avg_hooks import ops
    >>> ps = [torch.zeros(2, 3), torch.zeros(4, dtype=torch.float64)]
    >>> ops.unflatten_(torch.arange(10.0), ps)
    >>> ps[1].tolist()
    [6.0, 7.0, 8.0, 9.0]
    >>> ops.backend() in ("extension", "fallback")
    True
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType, SimpleNamespace

import torch

from . import _ext, _fallback, _quantize
from ._quantize import QuantLayout

SUPPORTED_DTYPES = _fallback.SUPPORTED_DTYPES
_EXT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # subclasses go to the reference loop

_FOREACH = SimpleNamespace(
    flatten=_fallback.foreach_flatten,
    unflatten_=_fallback.foreach_unflatten_,
    delta=_fallback.foreach_delta,
    apply_=_fallback.foreach_apply_,
    feedback_cast=_fallback.foreach_feedback_cast,
    apply_delta_=_fallback.foreach_apply_delta_,
    apply_progress_=_fallback.foreach_apply_progress_,
)


def backend() -> str:
    """``"extension"`` when the compiled ops are in use, else ``"fallback"``."""
    return "extension" if _ext.load_extension() is not None else "fallback"


def _as_list(params: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    return params if isinstance(params, (list, tuple)) else list(params)


# ---------------------------------------------------------------- validation


def _check_dtype(t: torch.Tensor, what: str, op: str) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{op}: {what} has dtype {t.dtype}; supported dtypes are float32, float16, "
            "bfloat16 and float64"
        )


def _check_flat(flat: torch.Tensor, params: Sequence[torch.Tensor], what: str, op: str) -> None:
    """Checks shared by every op: a contiguous 1-D buffer that fits ``params`` exactly."""
    _check_flats(((flat, what),), params, op)


def _check_flats(flats: Sequence[tuple[torch.Tensor, str]], params: Sequence[torch.Tensor],
                 op: str) -> None:
    """:func:`_check_flat` for each ``(flat, what)`` of one call, walking ``params`` once."""
    for flat, what in flats:
        if not isinstance(flat, torch.Tensor):
            raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(flat).__name__}")
        _check_dtype(flat, what, op)
        if flat.dim() != 1 or not flat.is_contiguous():
            raise ValueError(
                f"{op}: {what} must be a contiguous 1-D tensor, got shape {tuple(flat.shape)} "
                f"with strides {flat.stride()}"
            )
    device, first = flats[0][0].device, flats[0][1]
    total = 0
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{op}: params[{i}] must be a torch.Tensor, got {type(p).__name__}")
        if p.dtype not in SUPPORTED_DTYPES:
            _check_dtype(p, f"params[{i}]", op)
        if p.device != device:
            raise ValueError(
                f"{op}: params[{i}] is on {p.device} but {first} is on {device}; "
                "put all tensors of one call on one device"
            )
        total += p.numel()
    for flat, what in flats:
        if params and flat.device != device:
            raise ValueError(
                f"{op}: params[0] is on {device} but {what} is on {flat.device}; "
                "put all tensors of one call on one device"
            )
        if total != flat.numel():
            raise ValueError(
                f"{op}: {what} has {flat.numel()} elements but the parameters hold {total}; "
                "the buffer must have exactly sum(p.numel() for p in params) elements"
            )


# ---------------------------------------------------------------- routing


@functools.cache
def _foreach_devices() -> frozenset[str]:
    try:
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

        devices = _get_foreach_kernels_supported_devices()
    except ImportError:  # a torch without the helper
        devices = ["cuda"]
    # on the CPU the foreach ops are per-tensor loops in C++: still fewer temporaries here
    return frozenset(["cpu", *devices])


def _route(flats: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> str:
    """``"extension"``, ``"foreach"`` or ``"reference"``: who runs a validated call.

    ``flats`` are the call's flat buffers (all on the parameters' device).
    """
    tensors = [*flats, *params]
    if not all(type(t) in _PLAIN_TYPES for t in tensors):
        return "reference"
    dev = flats[0].device.type
    ext = _ext.load_extension()
    if (
        ext is not None
        and (dev == "cpu" or (dev == "cuda" and ext.with_cuda()))
        and all(t.dtype in _EXT_DTYPES for t in tensors)
    ):
        return "extension"
    return "foreach" if dev in _foreach_devices() else "reference"


def _impl(
    flats: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> ModuleType | SimpleNamespace:
    route = _route(flats, params)
    if route == "extension":
        return _ext.load_extension()
    return _FOREACH if route == "foreach" else _fallback


# ---------------------------------------------------------------- the ops

#: ``split_like(flat, params)``: views of ``flat`` shaped like ``params``, in order.
split_like = _fallback.split_like


def flatten(
    params: Sequence[torch.Tensor], out: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """``out <- cat([p.flatten() for p in params]) * scale``, cast to ``out.dtype``; returns
    ``out``."""
    params = _as_list(params)
    _check_flat(out, params, "out", "flatten")
    _impl((out,), params).flatten(params, out, scale)
    return out


def unflatten_(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``params`` in place, casting to each parameter's dtype."""
    params = _as_list(params)
    _check_flat(flat, params, "flat", "unflatten_")
    _impl((flat,), params).unflatten_(flat, params)


def delta(
    anchor: torch.Tensor,
    params: Sequence[torch.Tensor],
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """``out <- (anchor - flatten(params)) * scale``, cast to ``out.dtype``; returns ``out``."""
    params = _as_list(params)
    _check_flats(((anchor, "anchor"), (out, "out")), params, "delta")
    _impl((out, anchor), params).delta(anchor, params, out, scale)
    return out


def apply_(
    flat: torch.Tensor, params: Sequence[torch.Tensor], anchor: torch.Tensor | None = None
) -> None:
    """Write ``flat`` into ``params`` in place and, if given, into ``anchor``.

    The anchor receives exactly the values the parameters hold afterwards: ``flat``
    rounded to each parameter's dtype (the anchor must share the parameters' dtype).
    """
    params = _as_list(params)
    flats = (flat,) if anchor is None else (flat, anchor)
    _check_flats(tuple(zip(flats, ("flat", "anchor"))), params, "apply_")
    if anchor is not None:
        _check_same_dtype(anchor, "anchor", params, "apply_")
    _impl(flats, params).apply_(flat, params, anchor)


def _feedback_impl(anchor: torch.Tensor, flats: Sequence[torch.Tensor],
                   params: Sequence[torch.Tensor]) -> ModuleType | SimpleNamespace:
    """The extension's kernels want the anchor in the parameters' dtype; otherwise the
    chunked foreach tier (or the reference loop for what foreach cannot take)."""
    route = _route(flats, params)
    if route == "extension" and all(p.dtype == anchor.dtype for p in params):
        return _ext.load_extension()
    return _fallback if route == "reference" else _FOREACH


def _check_same_dtype(t: torch.Tensor, what: str, params, op: str) -> None:
    for i, p in enumerate(params):
        if p.dtype != t.dtype:
            raise TypeError(
                f"{op}: {what} has dtype {t.dtype} but params[{i}] has {p.dtype}; "
                f"the {what} must have the parameters' dtype"
            )


def feedback_cast(
    anchor: torch.Tensor,
    params: Sequence[torch.Tensor],
    residual: torch.Tensor,
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """Round the scaled change to ``out.dtype``, keeping what the rounding lost.

    With ``x = (anchor - flatten(params)) * scale + residual`` (float32 arithmetic,
    float64 if any tensor is float64): ``out <- x`` rounded to ``out.dtype`` and
    ``residual <- x - out`` rounded to ``residual.dtype``; returns ``out``. Any float
    dtypes; no temporary the size of the bucket.

    Example:
        >>> import torch
        >>> from ddp_avg_hooks import ops
        >>> anchor, p = torch.ones(3), [torch.zeros(3)]
        >>> residual = torch.zeros(3, dtype=torch.bfloat16)
        >>> out = ops.feedback_cast(anchor, p, residual, torch.empty(3, dtype=torch.float16), 1 / 3)
        >>> out[0].item(), residual[0].item()  # fp16(1/3) and the bf16 of what it lost
        (0.333251953125, 8.153915405273438e-05)
    """
    params = _as_list(params)
    _check_flats(((anchor, "anchor"), (residual, "residual"), (out, "out")), params,
                 "feedback_cast")
    _feedback_impl(anchor, (anchor, residual, out), params).feedback_cast(
        anchor, params, residual, out, scale)
    return out


def apply_delta_(anchor: torch.Tensor, change: torch.Tensor,
                 params: Sequence[torch.Tensor]) -> None:
    """``params <- anchor - change`` in place (rounded to the parameters' dtype), then
    ``anchor <- params``. ``change`` may have any float dtype; the anchor has the
    parameters' dtype. No temporary the size of the bucket."""
    params = _as_list(params)
    _check_flats(((anchor, "anchor"), (change, "change")), params, "apply_delta_")
    _check_same_dtype(anchor, "anchor", params, "apply_delta_")
    _feedback_impl(anchor, (anchor, change), params).apply_delta_(anchor, change, params)


def apply_progress_(values: torch.Tensor, launch: torch.Tensor,
                    params: Sequence[torch.Tensor], anchor: torch.Tensor | None = None) -> None:
    """Write an overlapped round: ``params <- params + (values - launch)`` in place, and
    ``anchor <- values`` (when an anchor is given).

    ``launch`` holds the parameters as the round began, so each parameter keeps the
    progress it made since. The correction ``values - launch`` is rounded to the
    parameters' dtype, then added to them (one more rounding), as
    ``params += (values - launch).to(dtype)`` would; the anchor receives ``values``
    rounded to the parameters' dtype. ``launch`` and ``anchor`` have the parameters'
    dtype, ``values`` any float dtype; ``launch`` is not changed. No temporary the size
    of the bucket. Without an anchor the call writes only the parameters: a caller
    whose ``values`` already have the parameters' dtype can keep ``values`` as the new
    anchor instead of copying them.

    Example:
        >>> import torch
        >>> from ddp_avg_hooks import ops
        >>> p, anchor = [torch.tensor([3.0, 5.0])], torch.zeros(2)
        >>> ops.apply_progress_(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 4.0]), p, anchor)
        >>> p[0].tolist(), anchor.tolist()  # each keeps its 1.0 of progress
        ([2.0, 2.0], [1.0, 1.0])
    """
    params = _as_list(params)
    flats = (values, launch) if anchor is None else (values, launch, anchor)
    _check_flats(tuple(zip(flats, ("values", "launch", "anchor"))), params, "apply_progress_")
    if anchor is not None:
        _check_same_dtype(anchor, "anchor", params, "apply_progress_")
    if anchor is None or launch.dtype != anchor.dtype:  # else checked with the anchor
        _check_same_dtype(launch, "launch", params, "apply_progress_")
    storages = {t.untyped_storage().data_ptr() for t in flats}
    if len(storages) < len(flats):  # a buffer passed twice: the reference reads first
        _fallback.apply_progress_(values, launch, params, anchor)
        return
    _feedback_impl(launch, flats, params).apply_progress_(values, launch, params, anchor)


# ---------------------------------------------------------------- blockwise quantization

_QUANT_DTYPES = (torch.float32, torch.float64)


def _check_vector(t, what: str, op: str, dtypes, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {what} has dtype {t.dtype}; expected {names}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{op}: {what} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} "
            f"with strides {t.stride()}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {what} is on {t.device} but packed is on {device}")


def _check_like(t, ref: torch.Tensor, what: str, ref_name: str, op: str) -> None:
    _check_vector(t, what, op, (ref.dtype,), ref.device)
    if t.numel() != ref.numel():
        raise ValueError(f"{op}: {what} has {t.numel()} elements but {ref_name} has {ref.numel()}")


def _check_packed(packed, layout: QuantLayout, op: str) -> None:
    if not isinstance(layout, QuantLayout):
        raise TypeError(f"{op}: layout must be a QuantLayout, got {type(layout).__name__}")
    _check_vector(packed, "packed", op, (torch.uint8,))
    if packed.numel() != layout.total_bytes:
        raise ValueError(
            f"{op}: packed has {packed.numel()} bytes but the layout needs {layout.total_bytes}"
        )


def _quant_impl(tensors: Sequence[torch.Tensor]):
    """The extension for plain float32 tensors on a device it was built for, else ``None``
    (the plain-PyTorch implementation)."""
    ext = _ext.load_extension()
    floats = [t for t in tensors if t.is_floating_point()]
    dev = tensors[0].device.type
    if (
        ext is not None
        and hasattr(ext, "quantize_blocks")
        and all(type(t) in _PLAIN_TYPES for t in tensors)
        and all(t.dtype == torch.float32 for t in floats)
        and (dev == "cpu" or (dev == "cuda" and ext.with_cuda()))
    ):
        return ext
    return None


def quantize_blocks(
    x: torch.Tensor,
    packed: torch.Tensor,
    layout: QuantLayout,
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    minus: torch.Tensor | None = None,
    scale: float = 1.0,
) -> None:
    """Quantize ``x + residual`` blockwise into ``packed``.

    ``x`` (float32 or float64) holds at most ``layout.elems`` values, the rest count as
    zeros; ``residual`` and ``residual_out`` (what the rounding lost, ``v - D``) are
    like ``x`` and may alias it or each other.

    ``minus`` (like ``x``): quantize the change ``(x - minus) * scale + residual``
    instead, the change made block by block as the codes are (no pass that writes it
    out). It equals ``ops.delta(x, [minus], d, scale)`` followed by
    ``quantize_blocks(d, ...)``, bit for bit; ``scale`` is ignored without ``minus``.

    Example:
        >>> import torch
        >>> from ddp_avg_hooks import ops
        >>> layout = ops.QuantLayout.for_bucket(4, 1, 4, 8)
        >>> packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        >>> ops.quantize_blocks(torch.tensor([3.0, 1.0, 1.0, 1.0]), packed, layout,
        ...                     minus=torch.tensor([1.0, 1.0, 1.0, 3.0]), scale=0.5)
        >>> ops.dequantize_blocks(packed, layout, torch.empty(4)).tolist()  # (x - minus) / 2
        [1.0, 0.0, 0.0, -1.0]
    """
    op = "quantize_blocks"
    _check_packed(packed, layout, op)
    _check_vector(x, "x", op, _QUANT_DTYPES, packed.device)
    if x.numel() > layout.elems:
        raise ValueError(f"{op}: x has {x.numel()} elements but the layout holds {layout.elems}")
    tensors = [packed, x]
    for t, what in ((residual, "residual"), (residual_out, "residual_out"), (minus, "minus")):
        if t is not None:
            _check_like(t, x, what, "x", op)
            tensors.append(t)
    if minus is not None and not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a Python float, got {type(scale).__name__}")
    ext = _quant_impl(tensors)
    if ext is None:
        _quantize.quantize_blocks(x, packed, layout, residual, residual_out, minus, scale)
    elif minus is None:
        ext.quantize_blocks(x, residual, packed, residual_out, layout.bits, layout.block_size,
                            layout.pieces, layout.piece_elems, layout.piece_bytes)
    else:
        ext.quantize_blocks(x, residual, packed, residual_out, layout.bits, layout.block_size,
                            layout.pieces, layout.piece_elems, layout.piece_bytes,
                            minus, float(scale))


def dequantize_blocks(
    packed: torch.Tensor,
    layout: QuantLayout,
    out: torch.Tensor,
    *,
    sum_pieces: bool = False,
    base: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize ``packed`` into ``out`` (float32 or float64); returns ``out``.

    ``sum_pieces=False``: the pieces back to back (``out`` holds at most
    ``layout.elems`` values), ``D``. ``sum_pieces=True``: the pieces added in order
    (``out`` holds at most ``layout.piece_elems`` values), ``D``. With ``base`` (the
    size and dtype of ``out``; it may be ``out`` itself), ``out = base - D`` in the same
    pass, the same bits as ``torch.sub(base, D)``.

    Example:
        >>> import torch
        >>> from ddp_avg_hooks import ops
        >>> layout = ops.QuantLayout.for_bucket(4, 2, 4, 8)  # two pieces of 4 values
        >>> packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
        >>> ops.quantize_blocks(torch.tensor([1.0, 2.0, 0, 0, 3.0, 0, 0, 0]), packed, layout)
        >>> total = ops.dequantize_blocks(packed, layout, torch.empty(4), sum_pieces=True)
        >>> total.tolist()  # piece 0 + piece 1, as int8 codes hold them
        [4.007874011993408, 2.0, 0.0, 0.0]
        >>> base = torch.full((4,), 10.0)
        >>> fused = ops.dequantize_blocks(packed, layout, torch.empty(4), sum_pieces=True,
        ...                               base=base)
        >>> torch.equal(fused, base - total)
        True
    """
    op = "dequantize_blocks"
    _check_packed(packed, layout, op)
    _check_vector(out, "out", op, _QUANT_DTYPES, packed.device)
    limit = layout.piece_elems if sum_pieces else layout.elems
    if out.numel() > limit:
        raise ValueError(f"{op}: out has {out.numel()} elements but the layout holds {limit}"
                         + (" per piece" if sum_pieces else ""))
    tensors = [packed, out]
    if base is not None:
        _check_like(base, out, "base", "out", op)
        tensors.append(base)
    ext = _quant_impl(tensors)
    if ext is None:
        return _quantize.dequantize_blocks(packed, layout, out, sum_pieces=sum_pieces, base=base)
    ext.dequantize_blocks(packed, base, out, layout.bits, layout.block_size, layout.pieces,
                          layout.piece_elems, layout.piece_bytes, bool(sum_pieces))
    return out


__all__ = ["backend", "flatten", "unflatten_", "delta", "apply_", "feedback_cast", "apply_delta_",
           "apply_progress_", "split_like", "SUPPORTED_DTYPES", "QuantLayout", "quantize_blocks",
           "dequantize_blocks"]
