"""The CPU's fast path for packed weights: torch's weight-only int4 and int8 matmuls over a layout
each format is repacked into once, at load (``prepare``).

- Q4_0, Q4_1, Q4_K: every group of 32 values is ``scale * (q - 8) + zero`` with ``q`` in 0..15,
  exactly (Q4_0: zero 0; Q4_1: zero ``m + 8 d``; Q4_K: scale ``d * sc``, zero ``8 d sc - dmin m``), which
  is what ``_weight_int4pack_mm_for_cpu`` computes, with scales and zeros in bf16.
- Q8_0, Q5_0, Q5_1: each block of 32 values is ``d * q (+ m)`` with ``q`` a signed byte, which is
  ``16 d * hi + d * lo`` for its nibbles ``hi = q >> 4`` and ``lo = q & 15``: two int4 planes side by
  side along K (the activations repeated), one ``_weight_int4pack_mm_for_cpu`` call. Its per-row
  result does not depend on how many rows the call has (each output sums its K in order), which
  one int8 call per block column also gave, at twice the time for 32 rows (a horizontal sum per
  output of each 32-value block).
- Q6_K: each block of 16 values is ``d * q`` with ``q`` a small integer (sub-blocks too small for
  the int4 groups); block ``b`` of every row is one ``[N, 16]`` int8 matrix, so the product is a sum
  over blocks of ``_weight_int8pack_mm(x_b, q_b) * d_b``.

Both matmuls are fast only with bf16 activations (fp32 takes a slow generic path): activations are
rounded to bf16 and results returned in the input dtype. Formats without a fast path here (Q2_K,
Q3_K, Q5_K) run through the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.quant import QuantizedTensor, WeightFormat, WeightKernels

_INT4_INNER_K_TILES = 2
_INT4_MM = torch._weight_int4pack_mm_for_cpu  # (the binding itself: torch.ops' wrapper is a Python call more)


class Int4Packed(WeightFormat):
    """``_convert_weight_to_int4pack_for_cpu``'s layout of a [N, planes * K] int4 weight: the packed
    nibbles then bf16 (scale, zero) pairs [planes * K / 32, N, 2], as one byte buffer. With two
    planes a value is the sum of its column in each (the activations go in twice). A table whose
    rows are also looked up (a tied embedding) keeps the source format's bytes after them: torch's
    packed layout has no rows to read."""

    block_values = 32
    kernels = {"cpu": "xinfer_cpu.quant:Int4Kernels"}

    def __init__(self, source: WeightFormat, rows: int, cols: int, planes: int = 1, with_rows: bool = False):
        self.name = f"{source.name}:cpu-int4" + ("x2" if planes == 2 else "")
        self.source, self.rows, self.cols, self.planes, self.with_rows = source, rows, cols, planes, with_rows
        self.block_bytes = 20 * planes + (source.row_bytes(32) if with_rows else 0)  # 16 of nibbles, 4 of bf16 pairs
        self._views: tuple[int, tuple[Tensor, Tensor, Tensor]] | None = None  # the views of the last buffer split

    def split(self, raw: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The packed nibbles, the scales and zeros, and (``with_rows``) the source bytes [N, row bytes]."""
        if self._views is None or self._views[0] != raw.data_ptr():  # a format per tensor: views made once
            raw = raw.as_subclass(Tensor)  # (a QuantizedTensor's bytes, as kernels read them)
            cols = self.planes * self.cols
            nibbles, pairs = self.rows * cols // 2, cols // 32 * self.rows * 4
            packed = raw[:nibbles].view(self.rows, cols // 2)
            scales_zeros = raw[nibbles : nibbles + pairs].view(torch.bfloat16).view(cols // 32, self.rows, 2)
            source = raw[nibbles + pairs :].view(self.rows, -1)
            self._views = (raw.data_ptr(), (packed, scales_zeros, source))
        return self._views[1]

    def dequantize(self, raw: Tensor) -> Tensor:
        packed, scales_zeros, _ = self.split(raw)
        eye = torch.eye(self.planes * self.cols, dtype=torch.bfloat16)
        planes = _INT4_MM(eye, packed, 32, scales_zeros).float().T
        return sum(planes.chunk(self.planes, dim=1)).contiguous()

    def dequantize_rows(self, raw: Tensor, index: Tensor) -> Tensor:
        if not self.with_rows:
            return self.dequantize(raw)[index]
        return self.source.dequantize_rows(self.split(raw)[2], index)


class BlockedInt8(WeightFormat):
    """A [N, K] weight as ``G = K / B`` int8 matrices [G, N, B] (block ``b`` of every row) and their
    float32 scales [G, N], as one byte buffer."""

    kernels = {"cpu": "xinfer_cpu.quant:Int8Kernels"}

    def __init__(self, source: str, rows: int, cols: int, block: int):
        self.name = f"{source}:cpu-int8"
        self.rows, self.cols, self.block_values = rows, cols, block
        self.block_bytes = block + 4
        self._views: tuple[int, tuple[Tensor, Tensor]] | None = None

    def split(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        if self._views is None or self._views[0] != raw.data_ptr():  # a format per tensor: views made once
            groups, n = self.cols // self.block_values, self.rows
            q = raw[: groups * n * self.block_values].view(torch.int8).view(groups, n, self.block_values)
            scales = raw[q.numel() :].view(torch.float32).view(groups, n)
            self._views = (raw.data_ptr(), (q, scales))
        return self._views[1]

    def dequantize(self, raw: Tensor) -> Tensor:
        q, scales = self.split(raw)
        return (q.float() * scales.unsqueeze(-1)).permute(1, 0, 2).reshape(self.rows, self.cols)

    def dequantize_rows(self, raw: Tensor, index: Tensor) -> Tensor:
        q, scales = self.split(raw)
        values = q[:, index].float() * scales[:, index].unsqueeze(-1)  # [G, ..., B]
        return values.movedim(0, -2).flatten(-2)


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
    # q4_k: 8 sub-blocks of 32 per 256-value block
    from xinfer.quant.gguf_formats import _k_nibbles, _k_scales

    blocks = raw.reshape(-1, 144)
    d, dmin = (blocks[:, i : i + 2].contiguous().view(torch.float16).float() for i in (0, 2))
    sc, mn = _k_scales(blocks[:, 4:16])
    scale, low = d * sc, dmin * mn  # value = scale * q - low
    q = _k_nibbles(blocks[:, 16:]).reshape(n, k)
    return q, scale.reshape(n, k // 32), (8 * scale - low).reshape(n, k // 32)


class Int4Kernels(WeightKernels):
    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None) -> Tensor:
        fmt = weight.format
        assert isinstance(fmt, Int4Packed)
        packed, scales_zeros, _ = fmt.split(weight)  # (the subclass's bytes: no plain view made per call)
        xb = (x if x.dim() == 2 else x.reshape(-1, fmt.cols)).to(torch.bfloat16)
        if fmt.planes == 2:
            xb = torch.cat([xb, xb], dim=-1)
        out = _INT4_MM(xb, packed, 32, scales_zeros).to(x.dtype)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], fmt.rows)
        return out if bias is None else out + bias


def _int4_pack(weight: QuantizedTensor, q: Tensor, scale: Tensor, zero: Tensor, rows: bool) -> QuantizedTensor:
    """``q`` [N, planes * K] in 0..15 and its groups' ``scale`` and ``zero`` [N, planes * K / 32] as an
    :class:`Int4Packed` weight of ``weight``'s values (and, for a looked-up table, its bytes)."""
    n, k = weight.logical_shape
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                _INT4_INNER_K_TILES)  # fmt: skip
    scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
    parts = [packed.flatten(), scales_zeros.view(torch.uint8).flatten()] + ([weight.raw.flatten()] if rows else [])
    fmt = Int4Packed(weight.format, n, k, planes=q.shape[1] // k, with_rows=rows)
    return QuantizedTensor(torch.cat(parts), fmt, (n, k))


def _int4_packs(weight: QuantizedTensor) -> bool:
    """torch's int4 packing takes rows in multiples of 16."""
    return len(weight.logical_shape) == 2 and weight.logical_shape[0] % 16 == 0


class Int4Repack(WeightKernels):
    """Q4_0, Q4_1, Q4_K: repacked for ``_weight_int4pack_mm_for_cpu``."""

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        if not _int4_packs(weight):
            return weight
        return _int4_pack(weight, *_int4_groups(weight), rows=False)


class Int4PlanesRepack(WeightKernels):
    """Q8_0, Q5_0, Q5_1: ``d * q + m`` as two int4 planes, ``16 d * hi`` and ``d * lo + m``."""

    def prepare(self, weight: QuantizedTensor, rows: bool = False) -> QuantizedTensor:
        if not _int4_packs(weight):
            return weight
        n, k = weight.logical_shape
        q, d, m, _ = _blocked_int8(weight)  # [N, K/32, 32], [N, K/32]
        hi, lo = (q >> 4) + 8, q & 15  # q = 16 (hi - 8) + lo
        planes = torch.cat([hi.reshape(n, k), lo.reshape(n, k)], dim=1)
        scale = torch.cat([16 * d, d], dim=1)
        zero = torch.cat([torch.zeros_like(d), 8 * d + (m if m is not None else 0)], dim=1)
        return _int4_pack(weight, planes, scale, zero, rows)

    def prepare_rows(self, weight: QuantizedTensor) -> QuantizedTensor:
        return self.prepare(weight, rows=True)


def _blocked_int8(weight: QuantizedTensor) -> tuple[Tensor, Tensor, Tensor | None, int]:
    """``q`` [N, G, B] int8, scales and mins [N, G] (float32) and ``B`` with value = scale * q + min."""
    n, k = weight.logical_shape
    name, raw = weight.format.name, weight.raw
    f16 = lambda b: b.contiguous().view(torch.float16).float().squeeze(-1)  # noqa: E731
    if name == "q8_0":
        blocks = raw.reshape(n, k // 32, 34)
        return blocks[..., 2:].view(torch.int8), f16(blocks[..., :2]), None, 32
    if name in ("q5_0", "q5_1"):
        fmt = weight.format
        blocks = raw.reshape(n, k // 32, fmt.block_bytes)
        d = f16(blocks[..., :2])
        values = fmt.dequantize(blocks.reshape(-1, fmt.block_bytes)).reshape(n, k // 32, 32)
        if name == "q5_0":
            return torch.round(values / d.unsqueeze(-1).where(d.unsqueeze(-1) != 0, 1)).to(torch.int8), d, None, 32
        m = f16(blocks[..., 2:4])
        q = torch.round((values - m.unsqueeze(-1)) / d.unsqueeze(-1).where(d.unsqueeze(-1) != 0, 1))
        return q.to(torch.int8), d, m, 32
    # q6_k: 16 sub-blocks of 16 per 256-value block, each d * scale_j * (q - 32)
    from xinfer.quant.gguf_formats import Q6_K

    blocks = raw.reshape(-1, 210)
    scale = (blocks[:, 208:210].contiguous().view(torch.float16).float()
             * blocks[:, 192:208].view(torch.int8).float())  # fmt: skip
    values = Q6_K().decode(blocks).reshape(-1, 16, 16)
    q = torch.round(values / scale.unsqueeze(-1).where(scale.unsqueeze(-1) != 0, 1))
    return q.to(torch.int8).reshape(n, k // 16, 16), scale.reshape(n, k // 16), None, 16


class Int8Repack(WeightKernels):
    """Q6_K: repacked into one int8 matrix per block column."""

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        if len(weight.logical_shape) != 2:
            return weight
        n, k = weight.logical_shape
        q, scales, _, block = _blocked_int8(weight)
        raw = torch.cat([q.transpose(0, 1).contiguous().view(torch.uint8).flatten(),
                         scales.T.contiguous().view(torch.uint8).flatten()])  # fmt: skip
        return QuantizedTensor(raw, BlockedInt8(weight.format.name, n, k, block), (n, k))

    prepare_rows = prepare  # rows of the repacked weight are looked up as fast (a tied embedding)


class Int8Kernels(WeightKernels):
    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None) -> Tensor:
        fmt = weight.format
        assert isinstance(fmt, BlockedInt8)
        q, scales = fmt.split(weight.raw)
        lead = x.shape[:-1]
        xb = x.reshape(-1, q.shape[0], fmt.block_values).to(torch.bfloat16)
        ones = torch.ones(fmt.rows, dtype=torch.bfloat16)
        out = torch.zeros(xb.shape[0], fmt.rows, dtype=torch.float32)
        for b in range(q.shape[0]):
            out.addcmul_(torch._weight_int8pack_mm(xb[:, b].contiguous(), q[b], ones).float(), scales[b])
        out = out.to(x.dtype).reshape(*lead, fmt.rows)
        return out if bias is None else out + bias


WEIGHT_KERNELS = {
    **{name: "xinfer_cpu.quant:Int4Repack" for name in ("q4_0", "q4_1", "q4_k")},
    **{name: "xinfer_cpu.quant:Int4PlanesRepack" for name in ("q8_0", "q5_0", "q5_1")},
    "q6_k": "xinfer_cpu.quant:Int8Repack",
}
"""The formats the CPU backend runs natively (repacked at load), by name."""
