"""MXFP4 and NVFP4 weights kept packed: 4-bit e2m1 values with a scale per small group of them.

e2m1 (OCP Microscaling spec): a sign bit, 2 exponent bits (bias 1) and 1 mantissa bit, so a code's
low 3 bits give the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 and bit 3 the sign. Checkpoints pack two
codes a byte, the even value in the low nibble. The formats here keep the checkpoint's bytes per
value but regroup each run of codes the way the GGUF 4-bit blocks do (the first half of a run in
the low nibbles, the second half in the high ones), so the packed-weight kernels decode a byte
range once per nibble (:mod:`xinfer_cuda.kernels.gguf_blocks`):

- ``mxfp4``: blocks of 32 values in 17 bytes, the e8m0 scale (``2 ** (byte - 127)``) then 16
  bytes of codes (value ``j`` in the low nibble of byte ``j``, ``j + 16`` in its high nibble):
  4.25 bits a value, the checkpoint's own size. A scale byte of 255 (NaN) is not a weight.
- ``nvfp4``: blocks of 128 values in 76 bytes: the tensor's float32 scale, eight e4m3 scales (one
  per 16 values), then 64 bytes of codes, 8 per 16 values (byte ``8 s + j``: value ``16 s + j`` low,
  ``16 s + 8 + j`` high); a value is ``code * e4m3 * scale``. 4.75 bits a
  value against the checkpoint's 4.5: the per-tensor scale is copied into every block, so rows
  of weights with different tensor scales can be merged (q/k/v, stacked experts), as the FP8
  format copies its scales (:mod:`xinfer.quant.fp8_format`). Rows of a length that is not a
  multiple of 128 are decoded at load instead.

``--isq mxfp4`` rounds each block of 32 to the nearest e2m1 values under the power of two that
puts its largest magnitude in [4, 8) (the spec's shared exponent); ``--isq nvfp4`` gives each
block of 128 its own float32 scale (its largest magnitude over 448 * 6) and each 16 values an e4m3
scale taking their largest magnitude to 6.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.quant.tensor import WeightFormat, divide

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
MXFP4_GROUP = 32
NVFP4_GROUP = 16
NVFP4_BLOCK = 128


def decode_e2m1(codes: Tensor) -> Tensor:
    """e2m1 codes (uint8, 0..15) -> float32 values: exponent field ``e`` and mantissa bit ``m`` stand for
    ``m / 2`` where ``e`` is 0, else ``(1 + m / 2) * 2 ** (e - 1)``. Elementwise, making no tensor (it runs
    inside captured CUDA graphs: an embedding's rows, the reference path)."""
    exponent, mantissa = ((codes >> 1) & 3).float(), (codes & 1).float()
    magnitude = torch.where(exponent == 0, mantissa / 2, (1 + mantissa / 2) * torch.exp2(exponent - 1))
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def encode_e2m1(values: Tensor) -> Tensor:
    """float values -> the nearest e2m1 codes (uint8), ties to the even code, beyond 6 saturated."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=values.device)
    magnitude = values.float().abs().clamp(max=E2M1_MAX)
    midpoints = (table[1:] + table[:-1]) / 2
    code = torch.bucketize(magnitude, midpoints)  # a midpoint goes to the code below it ...
    at_midpoint = (code < 7) & (magnitude == midpoints[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + at_midpoint.long()  # ... unless that code is odd: ties to even
    return (code | ((values < 0) & (code > 0)).long() << 3).to(torch.uint8)


def pair_codes(packed: Tensor) -> Tensor:
    """A checkpoint's bytes of two codes each, the even value low, [..., n] -> codes [..., 2n]."""
    codes = packed.contiguous().view(torch.uint8)
    return torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)


def run_nibbles(raw: Tensor, run: int) -> Tensor:
    """Bytes holding runs of ``run`` codes (the first half low, the second high), [..., n] -> [..., 2n]."""
    halves = raw.reshape(*raw.shape[:-1], -1, run // 2)
    return torch.cat((halves & 0xF, halves >> 4), dim=-1).flatten(-2)


def pack_runs(codes: Tensor, run: int) -> Tensor:
    """Codes [..., n] -> bytes [..., n / 2], each run of ``run`` codes as :func:`run_nibbles` reads it."""
    low, high = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, run).chunk(2, dim=-1)
    return (low | (high << 4)).flatten(-2)


class Mxfp4Format(WeightFormat):
    name = "mxfp4"
    block_values = MXFP4_GROUP
    block_bytes = 1 + MXFP4_GROUP // 2

    def dequantize(self, raw: Tensor) -> Tensor:
        blocks = raw.reshape(*raw.shape[:-1], -1, self.block_bytes)
        scales = torch.exp2(blocks[..., :1].float() - 127)
        return (decode_e2m1(run_nibbles(blocks[..., 1:], MXFP4_GROUP)) * scales).flatten(-2)

    def quantize(self, values: Tensor) -> Tensor:
        groups = values.float().reshape(*values.shape[:-1], -1, MXFP4_GROUP)
        largest = groups.abs().amax(-1, keepdim=True)
        # floor(log2(largest)), exactly (frexp's mantissa is in [0.5, 1)), less e2m1's largest exponent, 2
        exponent = torch.frexp(largest).exponent.float() - 1 - 2
        exponent = torch.where(largest > 0, exponent, -127).clamp(-127, 127)
        codes = encode_e2m1(groups * torch.exp2(-exponent)).flatten(-2)
        return pack_mxfp4(codes, (exponent + 127).to(torch.uint8).squeeze(-1))


def pack_mxfp4(codes: Tensor, scales: Tensor) -> Tensor:
    """e2m1 codes [..., K] in value order and their e8m0 scale bytes [..., K / 32] -> the format's bytes."""
    runs = pack_runs(codes, MXFP4_GROUP).reshape(*codes.shape[:-1], -1, MXFP4_GROUP // 2)
    return torch.cat((scales.contiguous().view(torch.uint8).unsqueeze(-1), runs), dim=-1).flatten(-2)


class Nvfp4Format(WeightFormat):
    name = "nvfp4"
    block_values = NVFP4_BLOCK
    block_bytes = 4 + NVFP4_BLOCK // NVFP4_GROUP + NVFP4_BLOCK // 2

    def dequantize(self, raw: Tensor) -> Tensor:
        blocks = raw.reshape(*raw.shape[:-1], -1, self.block_bytes)
        tensor_scales = blocks[..., :4].contiguous().view(torch.float32)
        scales = blocks[..., 4:12].contiguous().view(torch.float8_e4m3fn).float() * tensor_scales
        codes = run_nibbles(blocks[..., 12:], NVFP4_GROUP).unflatten(-1, (-1, NVFP4_GROUP))
        return (decode_e2m1(codes) * scales.unsqueeze(-1)).flatten(-3)

    def quantize(self, values: Tensor) -> Tensor:
        blocks = values.float().reshape(*values.shape[:-1], -1, NVFP4_BLOCK)
        tensor_scales = divide(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30), E4M3_MAX * E2M1_MAX)
        groups = blocks.unflatten(-1, (-1, NVFP4_GROUP))
        scales = (divide(groups.abs().amax(-1), E2M1_MAX) / tensor_scales).to(torch.float8_e4m3fn)
        steps = scales.float() * tensor_scales
        codes = encode_e2m1(torch.where(steps[..., None] > 0, groups / steps[..., None], 0.0))
        return pack_nvfp4(codes.flatten(-3), scales.flatten(-2), tensor_scales.squeeze(-1))


def pack_nvfp4(codes: Tensor, scales: Tensor, tensor_scales: Tensor) -> Tensor:
    """e2m1 codes [..., K] in value order, their e4m3 scales [..., K / 16] and a float32 scale per block
    of 128 ([..., K / 128], or anything broadcasting to it) -> the format's bytes."""
    *outer, cols = codes.shape
    blocks = cols // NVFP4_BLOCK
    tensor_scales = tensor_scales.float().expand(*outer, blocks).contiguous()
    parts = (
        tensor_scales.unsqueeze(-1).view(torch.uint8),
        scales.contiguous().view(torch.uint8).reshape(*outer, blocks, NVFP4_BLOCK // NVFP4_GROUP),
        pack_runs(codes, NVFP4_GROUP).reshape(*outer, blocks, NVFP4_BLOCK // 2),
    )
    return torch.cat(parts, dim=-1).flatten(-2)
