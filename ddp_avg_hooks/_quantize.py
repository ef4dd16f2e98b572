"""Blockwise absmax quantization in plain PyTorch: the wire layout and the reference ops.

A *payload* holds ``pieces`` pieces of ``piece_elems`` values each, cut into blocks of
``block_size`` values (``piece_elems`` is a multiple of ``block_size``, which is even).
Each piece is stored on its own, so that a collective can send piece ``j`` to rank ``j``::

    piece = [scales: blocks x float32][codes: piece_elems * bits / 8 bytes][zeros to 4 bytes]

With ``Q = 127`` (int8) or ``Q = 7`` (int4), per block of values ``v`` (all in float32,
or float64 when the inputs are float64; scales are float32 either way)::

    scale = float32(max|v| * (1 / Q))         # 1 / Q rounded to float32 (float64 inputs: not)
    d     = 1 if scale == 0 else scale        # an all-zero block: codes 0, never NaN
    q     = clamp(round_half_even(v / d), -Q, Q), or 0 where scale is nan or inf
    D     = q * scale                         # the dequantized value
    residual_out = v - D                      # what the rounding lost

int8 codes are ``q`` as ``int8``; int4 codes are ``q + 8`` (1..15) in 4 bits, element
``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in the high one.

2-bit codes have no zero: four levels ``q`` in ``{-1.5, -0.5, 0.5, 1.5}`` times the
block's root mean square (:func:`rms_scale`), so values beyond twice it are clipped to
``1.5 * scale`` and error feedback carries the rest::

    scale = rms_scale(block)                  # nan for a block holding nan or inf
    q     = clamp(floor(v / d) + 0.5, -1.5, 1.5), or -1.5 where scale is nan
    code  = q + 1.5 (0..3) in 2 bits, element 4i + k in bits 2k, 2k + 1 of byte i

Dequantization reads ``D = q * scale`` back; summing pieces adds them in piece order,
the first term taken as it is. Values past the inputs' end (up to the payload's size)
count as zeros (a 2-bit code decodes them to ``0.5 * scale``; no op reads them back).
A block holding nan (or inf) has a nan (or inf; 2-bit codes: nan) scale, so all
of its values decode to nan: a non-finite value is never lost in a round, and
``check_finite`` sees it.

These functions are the reference of the extension's fused kernels (``csrc/``), which
give the same bits for float32 (same float32 operations, in the same order; both round
half to even). They do not check their arguments: :mod:`ddp_avg_hooks.ops` does.

Example:
    >>> import torch
    >>> from ddp_avg_hooks import _quantize as Qz
    >>> layout = Qz.QuantLayout(bits=8, block_size=4, pieces=1, piece_elems=4)
    >>> packed = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    >>> Qz.quantize_blocks(torch.tensor([1.0, -0.5, 0.25, 0.0]), packed, layout)
    >>> layout.codes(packed).view(torch.int8).tolist()
    [[127, -64, 32, 0]]
    >>> Qz.dequantize_blocks(packed, layout, torch.empty(4)).tolist()
    [1.0, -0.5039370059967041, 0.25196850299835205, 0.0]
"""

from __future__ import annotations

import dataclasses
import functools

import torch

#: ``Q`` of the 8- and 4-bit codes: the block maximum over ``Q`` is the scale (2-bit
#: codes: :func:`rms_scale`)
QMAX = {8: 127, 4: 7}
BITS = (8, 4, 2)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclasses.dataclass(frozen=True)
class QuantLayout:
    """Where the scales and codes of each piece sit in a ``uint8`` payload."""

    bits: int
    block_size: int
    pieces: int
    piece_elems: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"QuantLayout: bits must be 8, 4 or 2, got {self.bits}")
        multiple = 4 if self.bits == 2 else 2  # codes never share a byte across blocks
        if self.block_size < 2 or self.block_size % multiple:
            raise ValueError(
                f"QuantLayout: block_size must be a multiple of {multiple} and >= 2 for "
                f"{self.bits}-bit codes, got {self.block_size}")
        if self.pieces < 1 or self.piece_elems < 0 or self.piece_elems % self.block_size:
            raise ValueError(
                f"QuantLayout: need pieces >= 1 and piece_elems a multiple of block_size, got "
                f"pieces={self.pieces}, piece_elems={self.piece_elems}, "
                f"block_size={self.block_size}"
            )

    @classmethod
    @functools.lru_cache(maxsize=1024)  # a round asks again for the same few layouts
    def for_bucket(cls, numel: int, world_size: int, block_size: int, bits: int) -> QuantLayout:
        """One piece per rank, each a whole number of blocks, covering ``numel`` values."""
        blocks = max(1, -(-numel // (world_size * block_size)))
        return cls(bits, block_size, world_size, blocks * block_size)

    @property
    def qmax(self) -> int:
        return QMAX[self.bits]

    @property
    def blocks(self) -> int:
        """Blocks per piece."""
        return self.piece_elems // self.block_size

    @property
    def code_bytes(self) -> int:
        """Bytes of one piece's codes, padded to a multiple of 4."""
        return _round_up(self.piece_elems * self.bits // 8, 4)

    @property
    def piece_bytes(self) -> int:
        return 4 * self.blocks + self.code_bytes

    @property
    def total_bytes(self) -> int:
        return self.pieces * self.piece_bytes

    @property
    def elems(self) -> int:
        """Values the payload holds (``numel`` rounded up)."""
        return self.pieces * self.piece_elems

    def one_piece(self) -> QuantLayout:
        """The layout of a single piece of this one."""
        return dataclasses.replace(self, pieces=1)

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - frozen, a few per registration
    def stacked(self, count: int) -> QuantLayout:
        """``count`` payloads of this one-piece layout back to back, each a piece: what an
        all-gather of it returns (``dequantize_blocks(..., sum_pieces=True)`` adds them).

        Example:
            >>> QuantLayout(bits=4, block_size=4, pieces=1, piece_elems=8).stacked(2).total_bytes
            24
        """
        if self.pieces != 1:
            raise ValueError(f"QuantLayout.stacked: needs a one-piece layout, got {self.pieces}")
        return dataclasses.replace(self, pieces=count)

    def scales(self, packed: torch.Tensor) -> torch.Tensor:
        """The ``(pieces, blocks)`` float32 scales, a view of ``packed``."""
        rows = packed.view(self.pieces, self.piece_bytes)
        return rows[:, : 4 * self.blocks].view(torch.float32)

    def codes(self, packed: torch.Tensor) -> torch.Tensor:
        """The ``(pieces, piece_elems * bits / 8)`` code bytes (no padding), a view of
        ``packed``."""
        rows = packed.view(self.pieces, self.piece_bytes)
        start = 4 * self.blocks
        return rows[:, start : start + self.piece_elems * self.bits // 8]

    @functools.lru_cache(maxsize=1024)  # noqa: B019 - frozen, a few per registration
    def payload_bytes(self, numel: int) -> int:
        """The bytes of :meth:`payload` (``numel`` values' scales and codes, no padding).

        Example:
            >>> QuantLayout(bits=4, block_size=4, pieces=2, piece_elems=8).payload_bytes(10)
            17
        """
        total = 0
        for i in range(self.pieces):
            real = min(max(numel - i * self.piece_elems, 0), self.piece_elems)
            if real:
                total += 4 * -(-real // self.block_size) + -(-real * self.bits // 8)
        return total

    def payload(self, packed: torch.Tensor, numel: int) -> list[torch.Tensor]:
        """Views of the scales and codes that carry the first ``numel`` values: what a
        rank's payload holds beside zero padding (``4 * ceil(numel / block_size)`` scale
        bytes and ``ceil(numel * bits / 8)`` code bytes)."""
        rows = packed.view(self.pieces, self.piece_bytes)
        out = []
        for i in range(self.pieces):
            real = min(max(numel - i * self.piece_elems, 0), self.piece_elems)
            if real:
                nblocks = -(-real // self.block_size)
                start = 4 * self.blocks
                out += [rows[i, : 4 * nblocks], rows[i, start : start + -(-real * self.bits // 8)]]
        return out


@torch.no_grad()
def quantize_blocks(x: torch.Tensor, packed: torch.Tensor, layout: QuantLayout,
                    residual: torch.Tensor | None = None,
                    residual_out: torch.Tensor | None = None,
                    minus: torch.Tensor | None = None, scale: float = 1.0) -> None:
    """Quantize ``v = x + residual`` (``x`` alone when ``residual`` is None) into ``packed``;
    ``residual_out`` (may alias ``x`` or ``residual``) receives ``v - D``. With ``minus``,
    ``x`` stands for the change ``(x - minus) * scale`` (each step rounded to ``x``'s
    dtype, as ``ops.delta`` computes it)."""
    n, ct = x.numel(), x.dtype
    v = torch.zeros(layout.elems, dtype=ct, device=x.device)
    if minus is not None:
        torch.sub(x, minus, out=v[:n]).mul_(scale)
        if residual is not None:
            v[:n].add_(residual)
    elif residual is None:
        v[:n].copy_(x)
    else:
        torch.add(x, residual, out=v[:n])
    vb = v.view(layout.pieces, layout.blocks, layout.block_size)
    amax = vb.abs().amax(dim=-1)
    if layout.bits == 2:
        scale = rms_scale(vb, amax)
    else:
        qmax = layout.qmax
        scale = (amax * (1.0 / qmax)).to(torch.float32)
    s = scale.to(ct).unsqueeze(-1)
    d = torch.where(s == 0, torch.ones_like(s), s)
    if layout.bits == 2:
        q = (torch.floor(vb / d) + 0.5).clamp_(-1.5, 1.5)
        q = torch.where(s.isnan(), -1.5, q)
    else:
        # a block holding nan or inf: its scale is nan or inf and its codes 0, so every
        # value of the block decodes to nan and a finite check sees it. Its quotients are
        # nan, or 0 (finite / inf), so codes 0 are the nan quotients made 0 (a nan has no
        # integer)
        q = torch.round(vb / d).clamp_(-qmax, qmax).nan_to_num_(nan=0.0)
    if residual_out is not None:
        residual_out.copy_((vb - q * s).view(-1)[:n])
    layout.scales(packed).copy_(scale)
    codes = layout.codes(packed)
    q = q.view(layout.pieces, layout.piece_elems)
    if layout.bits == 8:
        codes.view(torch.int8).copy_(q)
    elif layout.bits == 4:
        u = (q + 8).to(torch.uint8).view(layout.pieces, -1, 2)
        codes.copy_(u[..., 0] | (u[..., 1] << 4))
    else:
        u = (q + 1.5).to(torch.uint8).view(layout.pieces, -1, 4)
        codes.copy_(u[..., 0] | (u[..., 1] << 2) | (u[..., 2] << 4) | (u[..., 3] << 6))


def rms_scale(vb: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The 2-bit codes' float32 scale of each block (the rows of ``vb``, its maximum
    ``|v|`` in ``amax``): the block's root mean square, from a fixed-point sum of squares
    so that every implementation gets the same bits whatever order it adds in::

        t = v / amax;  k = floor(t * t * 2**24)     # an integer in [0, 2**24] per value
        scale = float32(amax * sqrt(sum(k) / (2**24 * block_size)))  # in float64

    0 for an all-zero block, nan for one holding nan or inf (no 2-bit level is 0, so
    the block decodes to nan).
    """
    a = amax.unsqueeze(-1)
    t = vb / torch.where(a == 0, torch.ones_like(a), a)
    k = torch.floor(t * t * float(2**24)).to(torch.int64).sum(dim=-1)
    mean_square = k.to(torch.float64) / (float(2**24) * vb.shape[-1])
    scale = (amax.to(torch.float64) * mean_square.sqrt()).to(torch.float32)
    return scale.masked_fill_(~torch.isfinite(amax), float("nan"))


def _decode(packed: torch.Tensor, layout: QuantLayout, ct: torch.dtype) -> torch.Tensor:
    """``(pieces, piece_elems)`` dequantized values ``q * scale`` in ``ct``."""
    codes = layout.codes(packed)
    if layout.bits == 8:
        q = codes.view(torch.int8).to(ct)
    elif layout.bits == 4:
        q = torch.stack((codes & 15, codes >> 4), dim=-1).to(ct).sub_(8)
    else:
        q = torch.stack((codes & 3, (codes >> 2) & 3, (codes >> 4) & 3, codes >> 6),
                        dim=-1).to(ct).sub_(1.5)
    q = q.view(layout.pieces, layout.blocks, layout.block_size)
    return (q * layout.scales(packed).to(ct).unsqueeze(-1)).view(layout.pieces, layout.piece_elems)


@torch.no_grad()
def dequantize_blocks(packed: torch.Tensor, layout: QuantLayout, out: torch.Tensor, *,
                      sum_pieces: bool = False, base: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize ``packed`` into ``out``; returns ``out``.

    ``sum_pieces=False``: the pieces back to back, ``D[j]``. ``sum_pieces=True``: the
    pieces added element-wise in order, ``D[j] = sum_i D_i[j]``. ``out[j] = D[j]``, or
    with ``base``, ``base[j] - D[j]``.
    """
    n = out.numel()
    d = _decode(packed, layout, out.dtype)
    if sum_pieces:
        # the sum goes into out unless out is base's memory (then a temporary)
        shared = (base is not None
                  and base.untyped_storage().data_ptr() == out.untyped_storage().data_ptr())
        total = torch.empty_like(out) if shared else out
        total.copy_(d[0, :n])
        for i in range(1, layout.pieces):
            total.add_(d[i, :n])
        if base is not None:
            torch.sub(base, total, out=out)
    elif base is None:
        out.copy_(d.view(-1)[:n])
    else:
        torch.sub(base, d.view(-1)[:n], out=out)
    return out
