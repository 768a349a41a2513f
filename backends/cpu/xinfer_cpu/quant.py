"""The CPU's fast path for packed weights: torch's weight-only int4 matmul over a layout each format
is repacked into once, at load (``prepare``).

- Q4_0, Q4_1, Q4_K: every group of 32 values is ``scale * (q - 8) + zero`` with ``q`` in 0..15,
  exactly (Q4_0: zero 0; Q4_1: zero ``m + 8 d``; Q4_K: scale ``d * sc``, zero ``8 d sc - dmin m``), which
  is what ``_weight_int4pack_mm_for_cpu`` computes, with scales and zeros in bf16.
- Q8_0, Q5_0, Q5_1, Q5_K: each block of 32 values is ``d * q + m`` with ``q`` a byte (Q5_K: a
  sub-block, ``d`` its scale and ``m`` minus its min), which is
  ``16 d * hi + d * lo`` for its nibbles ``hi = q >> 4`` and ``lo = q & 15``: two int4 planes side by
  side along K (the activations repeated), one ``_weight_int4pack_mm_for_cpu`` call. Its per-row
  result does not depend on how many rows the call has (each output sums its K in order), which
  one int8 call per block column also gave, at twice the time for 32 rows (a horizontal sum per
  output of each 32-value block).
- Q6_K: each sub-block of 16 values is ``d * q`` with ``q`` in -32..31, which is ``16 h + l`` for
  ``h`` in -2..2 and ``l`` in -8..7; a 32-group holds a sub-block's ``h`` codes then its ``l`` codes,
  scale ``d`` and zero 0, against activations ``16 x`` then ``x`` (exact in bf16). One int4 matmul
  over twice K, where one int8 matmul per 16-value block column (``_weight_int8pack_mm`` has one scale
  a row) took K / 16 calls a linear, 30 % of a Gemma-3-270M token.

The int4 matmul is fast only with bf16 activations (fp32 takes a slow generic path): activations are
rounded to bf16 and results returned in the input dtype. Q2_K and Q3_K (16-value sub-blocks whose
mins or scales a 32-group cannot share) run through the reference.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from xinfer.quant import QuantizedTensor, WeightFormat, WeightKernels
from xinfer.quant.gguf_formats import q4_k_parts, q5_k_parts, q6_k_parts

_INT4_INNER_K_TILES = 2
_INT4_MM = torch._weight_int4pack_mm_for_cpu  # (the binding itself: torch.ops' wrapper is a Python call more)


class Int4Packed(WeightFormat):
    """``_convert_weight_to_int4pack_for_cpu``'s layout of a [N, planes * K] int4 weight: the packed
    nibbles then bf16 (scale, zero) pairs [planes * K / 32, N, 2], as one byte buffer. With two
    ``planes`` a value is the sum of its column in each (the activations go in twice); with
    ``sixteens``, of the two halves of its 16-value sub-block's 32-group, the first weighted 16 (the
    activations of each sub-block go in as ``16 x`` then ``x``)."""

    block_values = 32
    kernels = {"cpu": "xinfer_cpu.quant:Int4Kernels"}

    def __init__(self, source: WeightFormat, rows: int, cols: int, planes: int = 1, sixteens: bool = False):
        self.name = f"{source.name}:cpu-int4" + ("x16" if sixteens else "x2" if planes == 2 else "")
        self.rows, self.cols, self.planes, self.sixteens = rows, cols, planes, sixteens
        self.block_bytes = 20 * planes  # 16 of nibbles, 4 of bf16 (scale, zero)
        self._views: tuple[int, tuple[Tensor, Tensor]] | None = None  # the views of the last buffer split

    def activations(self, x: Tensor) -> Tensor:
        """``x`` [M, K] (bf16) as the packed weight's K axis reads it."""
        if self.sixteens:
            sub_blocks = x.view(x.shape[0], -1, 16)
            return torch.cat([sub_blocks * 16, sub_blocks], dim=-1).flatten(1)
        return torch.cat([x, x], dim=-1) if self.planes == 2 else x

    def split(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        """The packed nibbles, and the scales and zeros."""
        if self._views is None or self._views[0] != raw.data_ptr():  # a format per tensor: views made once
            raw = raw.as_subclass(Tensor)  # (a QuantizedTensor's bytes, as kernels read them)
            cols = self.planes * self.cols
            nibbles = self.rows * cols // 2
            packed = raw[:nibbles].view(self.rows, cols // 2)
            scales_zeros = raw[nibbles:].view(torch.bfloat16).view(cols // 32, self.rows, 2)
            self._views = (raw.data_ptr(), (packed, scales_zeros))
        return self._views[1]

    def dequantize(self, raw: Tensor) -> Tensor:
        packed, scales_zeros = self.split(raw)
        eye = torch.eye(self.planes * self.cols, dtype=torch.bfloat16)
        return self._values(_INT4_MM(eye, packed, 32, scales_zeros).float().T)  # [N, planes * K]

    def dequantize_rows(self, raw: Tensor, index: Tensor) -> Tensor:
        if not int4_rows_readable():
            return self.dequantize(raw)[index]
        packed, scales_zeros = self.split(raw)
        rows = index.flatten().long()  # (byte offsets of a large table pass 2**31)
        codes = _int4_codes(packed, rows)  # [T, planes * K]
        scale, zero = scales_zeros[:, rows].float().permute(1, 0, 2).unsqueeze(-1).unbind(-2)  # [T, groups, 1]
        columns = (codes.view(len(rows), -1, 32) - 8) * scale + zero
        return self._values(columns.view(len(rows), -1)).view(*index.shape, self.cols)

    def _values(self, columns: Tensor) -> Tensor:
        """[T, planes * K] of the packed columns -> the weight's [T, K]."""
        if self.sixteens:
            high, low = columns.reshape(len(columns), -1, 2, 16).unbind(2)
            return (16 * high + low).reshape(len(columns), self.cols)
        return columns.reshape(len(columns), self.planes, self.cols).sum(1)


_TILE = 64  # the rows of one tile of torch's CPU int4 layout


def _int4_codes(packed: Tensor, rows: Tensor) -> Tensor:
    """The 4-bit codes [T, C] of ``rows`` of a [N, C] weight in ``_convert_weight_to_int4pack_for_cpu``'s
    layout: tiles of 64 rows, each column by column, a column's 64 codes in 32 bytes (row ``r`` in byte
    ``r % 32``, the high nibble from row 32 on); the last ``N % 64`` rows a tile of their own, its
    codes in row order. :func:`int4_rows_readable` checks this against the torch installed."""
    n, cols = packed.shape[0], 2 * packed.shape[1]
    full = n // _TILE * _TILE
    in_tile = rows < full
    r = torch.where(in_tile, rows % _TILE, rows - full)
    tile_start = torch.where(in_tile, rows // _TILE * _TILE, full) * cols // 2  # bytes before the row's tile
    column_bytes = torch.where(in_tile, _TILE, n - full) // 2
    position = torch.where(in_tile, 2 * (r % 32) + r // 32, r)  # the row's nibble within a column
    byte = tile_start[:, None] + torch.arange(cols) * column_bytes[:, None] + (position // 2)[:, None]
    return (packed.flatten()[byte].int() >> (4 * (position % 2))[:, None]) & 15


@functools.cache
def int4_rows_readable() -> bool:
    """Whether :func:`_int4_codes` reads this torch's int4 CPU layout (a probe of full and partial tiles)."""
    q = torch.randint(0, 16, (_TILE + 48, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, _INT4_INNER_K_TILES)
    return packed.shape == (len(q), 32) and torch.equal(_int4_codes(packed, torch.arange(len(q))), q)


def _int4_groups(weight: QuantizedTensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q`` [N, K] in 0..15 and, per group of 32, ``scale`` and ``zero`` [N, K/32] with
    value = scale * (q - 8) + zero."""
    raw = weight.raw
    n, k = weight.logical_shape
    name = weight.format.name
    if name in ("q4_0", "q4_1"):
        blocks = raw.reshape(n, k // 32, weight.format.block_bytes)
        d = blocks[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
        start = 2 if name == "q4_0" else 4
        nibbles = blocks[..., start:]
        q = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).reshape(n, k)
        zero = torch.zeros_like(d) if name == "q4_0" else blocks[..., 2:4].contiguous().view(torch.float16).float()
        zero = zero.reshape(d.shape) + (8 * d if name == "q4_1" else 0)
        return q, d, zero
    q, scale, low = q4_k_parts(raw.reshape(-1, weight.format.block_bytes))  # 8 sub-blocks of 32 per 256 values
    return q.reshape(n, k), scale.reshape(n, k // 32), (8 * scale - low).reshape(n, k // 32)


class Int4Kernels(WeightKernels):
    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None) -> Tensor:
        fmt = weight.format
        assert isinstance(fmt, Int4Packed)
        packed, scales_zeros = fmt.split(weight)  # (the subclass's bytes: no plain view made per call)
        xb = fmt.activations((x if x.dim() == 2 else x.reshape(-1, fmt.cols)).to(torch.bfloat16))
        out = _INT4_MM(xb, packed, 32, scales_zeros).to(x.dtype)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], fmt.rows)
        return out if bias is None else out + bias


def _int4_pack(
    weight: QuantizedTensor, q: Tensor, scale: Tensor, zero: Tensor, sixteens: bool = False
) -> QuantizedTensor:
    """``q`` [N, planes * K] in 0..15 and its groups' ``scale`` and ``zero`` [N, planes * K / 32] as an
    :class:`Int4Packed` weight of ``weight``'s values."""
    n, k = weight.logical_shape
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), _INT4_INNER_K_TILES)
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    fmt = Int4Packed(weight.format, n, k, planes=q.shape[1] // k, sixteens=sixteens)
    return QuantizedTensor(torch.cat([packed.flatten(), scales_zeros.view(torch.uint8).flatten()]), fmt, (n, k))


def _int4_packs(weight: QuantizedTensor) -> bool:
    """torch's int4 packing takes rows in multiples of 16."""
    return len(weight.logical_shape) == 2 and weight.logical_shape[0] % 16 == 0


class _Int4Repack(WeightKernels):
    def prepare_rows(self, weight: QuantizedTensor) -> QuantizedTensor:
        """A table also looked up (a tied embedding) is repacked too where its rows can be read back."""
        return self.prepare(weight) if int4_rows_readable() else weight


class Int4Repack(_Int4Repack):
    """Q4_0, Q4_1, Q4_K: repacked for ``_weight_int4pack_mm_for_cpu``."""

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        if not _int4_packs(weight):
            return weight
        return _int4_pack(weight, *_int4_groups(weight))


class Int4PlanesRepack(_Int4Repack):
    """Q8_0, Q5_0, Q5_1, Q5_K: ``d * q + m`` as two int4 planes, ``16 d * hi`` and ``d * lo + m``."""

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        if not _int4_packs(weight):
            return weight
        n, k = weight.logical_shape
        q, d, m = _blocked_int8(weight)  # [N, K/32, 32], [N, K/32]
        hi, lo = (q >> 4) + 8, q & 15  # q = 16 (hi - 8) + lo
        planes = torch.cat([hi.reshape(n, k), lo.reshape(n, k)], dim=1)
        scale = torch.cat([16 * d, d], dim=1)
        zero = torch.cat([torch.zeros_like(d), 8 * d + (m if m is not None else 0)], dim=1)
        return _int4_pack(weight, planes, scale, zero)


def _blocked_int8(weight: QuantizedTensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """``q`` [N, K / 32, 32] int8, and scales and mins [N, K / 32] (float32), with value = scale * q + min."""
    n, k = weight.logical_shape
    name, raw = weight.format.name, weight.raw
    f16 = lambda b: b.contiguous().view(torch.float16).float().squeeze(-1)  # noqa: E731
    if name == "q8_0":
        blocks = raw.reshape(n, k // 32, 34)
        return blocks[..., 2:].view(torch.int8), f16(blocks[..., :2]), None
    if name in ("q5_0", "q5_1"):
        fmt = weight.format
        blocks = raw.reshape(n, k // 32, fmt.block_bytes)
        d = f16(blocks[..., :2])
        values = fmt.dequantize(blocks.reshape(-1, fmt.block_bytes)).reshape(n, k // 32, 32)
        if name == "q5_0":
            return torch.round(values / d.unsqueeze(-1).where(d.unsqueeze(-1) != 0, 1)).to(torch.int8), d, None
        m = f16(blocks[..., 2:4])
        q = torch.round((values - m.unsqueeze(-1)) / d.unsqueeze(-1).where(d.unsqueeze(-1) != 0, 1))
        return q.to(torch.int8), d, m
    if name == "q5_k":
        q, scale, low = q5_k_parts(raw.reshape(-1, weight.format.block_bytes))
        return q.to(torch.int8).reshape(n, k // 32, 32), scale.reshape(n, k // 32), -low.reshape(n, k // 32)
    raise ValueError(f"{name} has no int8 blocks here")


class Int4SixteensRepack(_Int4Repack):
    """Q6_K: ``d * q`` per 16 values, ``q = 16 h + l``, as 32-groups of the ``h`` then the ``l`` codes."""

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        if not _int4_packs(weight):
            return weight
        n, k = weight.logical_shape
        q, scale = q6_k_parts(weight.raw.reshape(-1, weight.format.block_bytes))  # [blocks, 16, 16], [blocks, 16]
        q = q.reshape(-1, 16)
        high = torch.div(q + 8, 16, rounding_mode="floor")  # q in -32..31: high in -2..2, q - 16 high in -8..7
        codes = torch.stack([high + 8, q - 16 * high + 8], dim=-2)  # [blocks * 16, 2, 16]
        scale = scale.reshape(n, k // 16)
        return _int4_pack(weight, codes.reshape(n, 2 * k), scale, torch.zeros_like(scale), sixteens=True)


WEIGHT_KERNELS = {
    **{name: "xinfer_cpu.quant:Int4Repack" for name in ("q4_0", "q4_1", "q4_k")},
    **{name: "xinfer_cpu.quant:Int4PlanesRepack" for name in ("q8_0", "q5_0", "q5_1", "q5_k")},
    "q6_k": "xinfer_cpu.quant:Int4SixteensRepack",
}
"""The formats the CPU backend runs natively (repacked at load), by name."""
