"""The CPU's fast path for packed weights: torch's weight-only int4 and int8 matmuls over a layout
each format is repacked into once, at load (``prepare``).

- Q4_0, Q4_1, Q4_K: every group of 32 values is ``scale * (q - 8) + zero`` with ``q`` in 0..15,
  exactly (Q4_0: zero 0; Q4_1: zero ``m + 8 d``; Q4_K: scale ``d * sc``, zero ``8 d sc - dmin m``), which
  is what ``_weight_int4pack_mm_for_cpu`` computes, with scales and zeros in bf16.
- Q8_0, Q5_0, Q5_1, Q6_K: each block of ``B`` values is ``d * q (+ m)`` with ``q`` a small integer;
  block ``b`` of every row is one ``[N, B]`` int8 matrix, so the product is a sum over blocks of
  ``_weight_int8pack_mm(x_b, q_b) * d_b`` (plus ``sum(x_b) * m_b``), exact but for the bf16 rounding
  of activations and of each block's partial sum.

Both matmuls are fast only with bf16 activations (fp32 takes a slow generic path): activations are
rounded to bf16 and results returned in the input dtype. Formats without a fast path here (Q2_K,
Q3_K, Q5_K) run through the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.quant import QuantizedTensor, WeightFormat, WeightKernels

_INT4_INNER_K_TILES = 2


class Int4Packed(WeightFormat):
    """``_convert_weight_to_int4pack_for_cpu``'s layout of a [N, K] weight: the packed nibbles
    [N, K/2] then bf16 (scale, zero) pairs [K/32, N, 2], as one byte buffer."""

    block_values, block_bytes = 32, 20
    kernels = {"cpu": "xinfer_cpu.quant:Int4Kernels"}

    def __init__(self, source: str, rows: int, cols: int):
        self.name = f"{source}:cpu-int4"
        self.rows, self.cols = rows, cols
        self._views: tuple[int, tuple[Tensor, Tensor]] | None = None  # the views of the last buffer split

    def split(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        if self._views is None or self._views[0] != raw.data_ptr():  # a format per tensor: views made once
            nibbles = self.rows * self.cols // 2
            packed = raw[:nibbles].view(self.rows, self.cols // 2)
            scales_zeros = raw[nibbles:].view(torch.bfloat16).view(self.cols // 32, self.rows, 2)
            self._views = (raw.data_ptr(), (packed, scales_zeros))
        return self._views[1]

    def dequantize(self, raw: Tensor) -> Tensor:
        packed, scales_zeros = self.split(raw)
        eye = torch.eye(self.cols, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, 32, scales_zeros).float().T.contiguous()


class BlockedInt8(WeightFormat):
    """A [N, K] weight as ``G = K / B`` int8 matrices [G, N, B] (block ``b`` of every row), their
    scales [G, N] (and mins [G, N]) in ``scale_dtype``, as one byte buffer."""

    kernels = {"cpu": "xinfer_cpu.quant:Int8Kernels"}

    def __init__(self, source: str, rows: int, cols: int, block: int, scale_dtype: torch.dtype, mins: bool):
        self.name = f"{source}:cpu-int8"
        self.source = source
        self.rows, self.cols, self.block_values = rows, cols, block
        self.scale_dtype, self.mins = scale_dtype, mins
        self.block_bytes = block + (1 + mins) * scale_dtype.itemsize
        self._views: tuple[int, tuple[Tensor, Tensor, Tensor | None]] | None = None

    def split(self, raw: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        if self._views is None or self._views[0] != raw.data_ptr():  # a format per tensor: views made once
            groups, n = self.cols // self.block_values, self.rows
            q = raw[: groups * n * self.block_values].view(torch.int8).view(groups, n, self.block_values)
            rest = raw[q.numel() :].view(self.scale_dtype).view(1 + self.mins, groups, n)
            self._views = (raw.data_ptr(), (q, rest[0], rest[1] if self.mins else None))
        return self._views[1]

    def dequantize(self, raw: Tensor) -> Tensor:
        q, scales, mins = self.split(raw)
        values = q.float() * scales.float().unsqueeze(-1)
        if mins is not None:
            values = values + mins.float().unsqueeze(-1)
        return values.permute(1, 0, 2).reshape(self.rows, self.cols)

    def dequantize_rows(self, raw: Tensor, index: Tensor) -> Tensor:
        q, scales, mins = self.split(raw)
        values = q[:, index].float() * scales[:, index].float().unsqueeze(-1)  # [G, ..., B]
        if mins is not None:
            values = values + mins[:, index].float().unsqueeze(-1)
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
        packed, scales_zeros = fmt.split(weight.raw)
        lead = x.shape[:-1]
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, fmt.cols).to(torch.bfloat16), packed, 32,
                                                         scales_zeros)  # fmt: skip
        out = out.to(x.dtype).reshape(*lead, fmt.rows)
        return out if bias is None else out + bias


class Int4Repack(WeightKernels):
    """Q4_0, Q4_1, Q4_K: repacked for ``_weight_int4pack_mm_for_cpu``."""

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        if len(weight.logical_shape) != 2:
            return weight
        n, k = weight.logical_shape
        q, scale, zero = _int4_groups(weight)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(),
                                                                    _INT4_INNER_K_TILES)  # fmt: skip
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).to(torch.bfloat16).contiguous()
        raw = torch.cat([packed.flatten(), scales_zeros.view(torch.uint8).flatten()])
        return QuantizedTensor(raw, Int4Packed(weight.format.name, n, k), (n, k))


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
    """Q8_0, Q5_0, Q5_1, Q6_K: repacked into one int8 matrix per block column."""

    prepared_rows = True  # rows of the repacked weight are looked up as fast (a tied embedding)

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        if len(weight.logical_shape) != 2:
            return weight
        n, k = weight.logical_shape
        q, scales, mins, block = _blocked_int8(weight)
        scale_dtype = torch.float16 if weight.format.name != "q6_k" else torch.float32
        parts = [q.transpose(0, 1).contiguous().view(torch.uint8).flatten()]
        for values in (scales, mins):
            if values is not None:
                parts.append(values.T.to(scale_dtype).contiguous().view(torch.uint8).flatten())
        fmt = BlockedInt8(weight.format.name, n, k, block, scale_dtype, mins is not None)
        return QuantizedTensor(torch.cat(parts), fmt, (n, k))


class Int8Kernels(WeightKernels):
    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None) -> Tensor:
        fmt = weight.format
        assert isinstance(fmt, BlockedInt8)
        q, scales, mins = fmt.split(weight.raw)
        lead = x.shape[:-1]
        xb = x.reshape(-1, q.shape[0], fmt.block_values).to(torch.bfloat16)
        ones = torch.ones(fmt.rows, dtype=torch.bfloat16)
        out = torch.zeros(xb.shape[0], fmt.rows, dtype=torch.float32)
        for b in range(q.shape[0]):
            partial = torch.ops.aten._weight_int8pack_mm(xb[:, b].contiguous(), q[b], ones)
            out.addcmul_(partial.float(), scales[b].float())
        if mins is not None:
            out.addmm_(xb.float().sum(-1), mins.float())
        out = out.to(x.dtype).reshape(*lead, fmt.rows)
        return out if bias is None else out + bias


WEIGHT_KERNELS = {
    **{name: "xinfer_cpu.quant:Int4Repack" for name in ("q4_0", "q4_1", "q4_k")},
    **{name: "xinfer_cpu.quant:Int8Repack" for name in ("q8_0", "q5_0", "q5_1", "q6_k")},
}
"""The formats the CPU backend runs natively (repacked at load), by name."""
