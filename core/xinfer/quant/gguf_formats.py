"""llama.cpp's GGUF block formats in torch: each block's bytes to its values, vectorized over
every block at once, and back (``--isq``): the legacy types as llama.cpp rounds them, bit for bit; the K types'
scales and mins fitted as its reference quantizers fit them (weighted least squares over candidate roundings).

Layouts, per block (``f16``: an IEEE half; ``q``: the quantized values):

- Q8_0  (32 values, 34 bytes):  d f16, 32 int8 q;                 x = d*q
- Q4_0  (32, 18):   d, 16 bytes of nibbles (low nibbles are values 0..15, high 16..31);  x = d*(q-8)
- Q4_1  (32, 20):   d, m, 16 bytes of nibbles;                   x = d*q + m
- Q5_0  (32, 22):   d, qh u32 (bit j: the 5th bit of value j), nibbles;   x = d*(q-16)
- Q5_1  (32, 24):   d, m, qh, nibbles;                           x = d*q + m
- Q2_K  (256, 84):  16 sub-scales (low nibble scale, high nibble min), 64 bytes of 2-bit q, d, dmin
- Q3_K  (256, 110): 32 bytes of high bits, 64 bytes of 2-bit q, 12 bytes of 16 6-bit scales, d
- Q4_K  (256, 144): d, dmin, 12 bytes of 8 6-bit scales and 8 6-bit mins, 128 bytes of nibbles
- Q5_K  (256, 176): as Q4_K, then 32 bytes of high bits before the nibbles
- Q6_K  (256, 210): 128 bytes of low nibbles, 64 bytes of high 2 bits, 16 int8 scales, d

In the K formats a super-block of 256 values has sub-blocks of 16 or 32, each with a 4-, 6- or
8-bit scale (and min) relative to the super-block's f16 ``d`` (and ``dmin``). Rows that are not whole
super-blocks take the 32-value type llama.cpp's quantizer gives them (``fallback``: Q4_K's Q5_0, Q6_K's Q8_0...;
Q2_K's and Q3_K's Q4_0, where llama.cpp's is IQ4_NL, which xinfer does not pack).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from xinfer.quant.tensor import WeightFormat, divide

QK_K = 256


def _f16(raw: Tensor) -> Tensor:
    """Little-endian f16 pairs [..., 2k] -> float32 [..., k]."""
    return raw.contiguous().view(torch.float16).float()


_SHIFTS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _shifted(raw: Tensor, shifts: list[int], mask: int) -> Tensor:
    """Bit fields of each byte: [..., n] -> [..., len(shifts), n], field ``i`` = ``(b >> shifts[i]) & mask``."""
    key = (tuple(shifts), raw.device)
    if key not in _SHIFTS:  # made once per device, not inside a captured CUDA graph's replayed steps
        _SHIFTS[key] = torch.tensor(shifts, dtype=torch.uint8, device=raw.device)[:, None]
    return (raw.unsqueeze(-2) >> _SHIFTS[key]) & mask


def _nibbles(raw: Tensor) -> Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones."""
    return _shifted(raw, [0, 4], 0xF).flatten(-2)


def _bits(raw: Tensor, count: int) -> Tensor:
    """[..., n] bytes -> [..., count * n]: bit 0 of every byte, then bit 1, ..."""
    return _shifted(raw, list(range(count)), 1).flatten(-2)


def _qh_bits(qh: Tensor) -> Tensor:
    """The 32 bits of a little-endian u32 [..., 4] -> [..., 32], bit j of the word at j."""
    return _shifted(qh, list(range(8)), 1).transpose(-1, -2).flatten(-2)


def _half(x: Tensor) -> Tensor:
    """float32 [..., 1] -> its f16 bytes [..., 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _pack_nibbles(q: Tensor) -> Tensor:
    """[..., 2n] values < 16 -> [..., n] bytes (inverse of :func:`_nibbles`)."""
    low, high = q.to(torch.uint8).chunk(2, dim=-1)
    return low | (high << 4)


def _round_away(x: Tensor) -> Tensor:
    """Round half away from zero (C's roundf, as llama.cpp's quantizers round)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _inverse(d: Tensor) -> Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


class GGUFBlockFormat(WeightFormat):
    """A GGUF block format: :meth:`dequantize` reshapes to one row per block and calls
    :meth:`decode` (and :meth:`quantize` :meth:`encode`)."""

    ggml_type: ClassVar[str]  # gguf.GGMLQuantizationType's name

    def dequantize(self, raw: Tensor) -> Tensor:
        *outer, row = raw.shape
        blocks = raw.reshape(-1, self.block_bytes)
        return self.decode(blocks).reshape(*outer, row // self.block_bytes * self.block_values)

    def quantize(self, values: Tensor) -> Tensor:
        *outer, row = values.shape
        blocks = values.float().reshape(-1, self.block_values)
        return self.encode(blocks).reshape(*outer, row // self.block_values * self.block_bytes)

    def decode(self, blocks: Tensor) -> Tensor:
        """uint8 [B, block_bytes] -> float32 [B, block_values]."""
        raise NotImplementedError

    def encode(self, blocks: Tensor) -> Tensor:
        """float32 [B, block_values] -> uint8 [B, block_bytes]."""
        raise NotImplementedError(f"weights cannot be quantized to {self.name} at load")


class Q8_0(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q8_0", "Q8_0", 32, 34

    def decode(self, blocks: Tensor) -> Tensor:
        return _f16(blocks[:, :2]) * blocks[:, 2:].view(torch.int8).float()

    def encode(self, blocks: Tensor) -> Tensor:
        d = divide(blocks.abs().amax(-1, keepdim=True), 127)
        q = _round_away(blocks * _inverse(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_half(d), q], dim=-1)


class Q4_0(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q4_0", "Q4_0", 32, 18

    def decode(self, blocks: Tensor) -> Tensor:
        return _f16(blocks[:, :2]) * (_nibbles(blocks[:, 2:]).float() - 8)

    def encode(self, blocks: Tensor) -> Tensor:
        d = divide(_signed_absmax(blocks), -8)
        q = torch.trunc(blocks * _inverse(d) + 8.5).clamp(0, 15)
        return torch.cat([_half(d), _pack_nibbles(q)], dim=-1)


class Q4_1(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q4_1", "Q4_1", 32, 20

    def decode(self, blocks: Tensor) -> Tensor:
        return _f16(blocks[:, :2]) * _nibbles(blocks[:, 4:]).float() + _f16(blocks[:, 2:4])

    def encode(self, blocks: Tensor) -> Tensor:
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = divide(high - low, 15)
        q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 15)
        return torch.cat([_half(d), _half(low), _pack_nibbles(q)], dim=-1)


class Q5_0(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q5_0", "Q5_0", 32, 22

    def decode(self, blocks: Tensor) -> Tensor:
        q = _nibbles(blocks[:, 6:]) | (_qh_bits(blocks[:, 2:6]) << 4)
        return _f16(blocks[:, :2]) * (q.float() - 16)

    def encode(self, blocks: Tensor) -> Tensor:
        d = divide(_signed_absmax(blocks), -16)
        q = torch.trunc(blocks * _inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
        return torch.cat([_half(d), _pack_high_bits(q), _pack_nibbles(q & 0xF)], dim=-1)


class Q5_1(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q5_1", "Q5_1", 32, 24

    def decode(self, blocks: Tensor) -> Tensor:
        q = _nibbles(blocks[:, 8:]) | (_qh_bits(blocks[:, 4:8]) << 4)
        return _f16(blocks[:, :2]) * q.float() + _f16(blocks[:, 2:4])

    def encode(self, blocks: Tensor) -> Tensor:
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d = divide(high - low, 31)
        q = torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, 31).to(torch.uint8)
        return torch.cat([_half(d), _half(low), _pack_high_bits(q), _pack_nibbles(q & 0xF)], dim=-1)


def _signed_absmax(blocks: Tensor) -> Tensor:
    """Each block's value of largest magnitude, with its sign [B, 1]."""
    return blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))


def _pack_high_bits(q: Tensor) -> Tensor:
    """Bit 4 of each of 32 values -> the little-endian u32 ``qh`` [B, 4]."""
    bits = ((q >> 4) & 1).reshape(-1, 4, 8).to(torch.int32)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=q.device)
    return (bits * weights).sum(-1).to(torch.uint8)


def _sum(x: Tensor) -> Tensor:
    """The sum over the last dim (a power of two) [..., 1], added in pairs in a fixed order: every device rounds it
    alike, so a fit picks the same candidate on a GPU as on the CPU (torch's ``sum`` orders its additions per
    device, and near-equal candidates were told apart differently: an H200 packed ``--isq q4_k`` otherwise)."""
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x


def _least_squares_affine(x: Tensor, q: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``scale`` and ``offset`` [..., 1] of ``scale * q + offset`` closest to ``x`` in the ``w``-weighted squared
    error, the offset at most 0 (a K format stores it as a min subtracted), and where they exist (the system's
    determinant positive: ``q`` not constant)."""
    sw, sq, sq2, sx, sxq = _sum(w), _sum(w * q), _sum(w * q * q), _sum(w * x), _sum(w * x * q)
    det = sw * sq2 - sq * sq
    exists = det > 0
    det = torch.where(exists, det, 1.0)
    scale, offset = (sw * sxq - sx * sq) / det, (sq2 * sx - sq * sxq) / det
    positive = offset > 0
    scale = torch.where(positive, sxq / torch.where(sq2 > 0, sq2, 1.0), scale)
    return scale, torch.where(positive, torch.zeros_like(offset), offset), exists


def _fit_affine(x: Tensor, levels: int, w: Tensor, rmin: float, rdelta: float, steps: int) -> tuple[Tensor, Tensor]:
    """Per sub-block (the last dim) of ``x``: ``scale`` and ``low`` >= 0 [...] with ``scale * q - low`` (``q`` in
    0..levels) closest to ``x`` in the ``w``-weighted squared error. As llama.cpp's ``make_qkx2_quants``: the plain
    min/max rounding, then ``x`` rounded over its span cut into ``levels + rmin + rdelta * i`` steps for each ``i``
    up to ``steps``, each rounding least-squares fitted; the best kept."""
    low = x.amin(-1, keepdim=True).clamp(max=0)
    span = x.amax(-1, keepdim=True) - low
    nonzero_span = torch.where(span > 0, span, 1.0)

    def rounding(steps_over_span: Tensor) -> Tensor:  # as the reference: (steps / span) * (x - low), half to even
        return torch.round(steps_over_span * (x - low)).clamp(0, levels)

    iscale = torch.where(span > 0, levels / nonzero_span, 0.0)
    best_scale, best_offset = torch.where(span > 0, 1 / torch.where(iscale > 0, iscale, 1.0), 0.0), low
    q = rounding(iscale)
    best_error = _sum(w * (best_scale * q + low - x) ** 2)
    for i in range(steps + 1):
        # the reference's float arithmetic: (rmin + rdelta * i) + levels, then / span
        step_count = torch.tensor(rmin, dtype=torch.float32) + torch.tensor(rdelta, dtype=torch.float32) * i + levels
        q = rounding(torch.where(span > 0, step_count.to(x.device) / nonzero_span, 0.0))
        scale, offset, exists = _least_squares_affine(x, q, w)
        error = _sum(w * (scale * q + offset - x) ** 2)
        better = exists & (error < best_error)
        best_scale, best_offset = torch.where(better, scale, best_scale), torch.where(better, offset, best_offset)
        best_error = torch.where(better, error, best_error)
    return best_scale.squeeze(-1).clamp(min=0), -best_offset.squeeze(-1)


def _fit_symmetric(x: Tensor, levels: int, w: Tensor, tries: int = 8, rounds: int = 2) -> Tensor:
    """Per sub-block of ``x``: the signed ``scale`` [...] with ``scale * q`` (``q`` in ``-levels..levels - 1``)
    closest to ``x`` in the ``w``-weighted squared error: the value of largest magnitude mapped to ``-levels``
    (``-levels - 0.1 i`` for ``i < tries``), then ``rounds`` of rounding to the least-squares scale and back
    (what llama.cpp's ``make_q3_quants`` searches element by element)."""
    peak = _signed_absmax(x)
    best_scale, best_error = torch.zeros_like(peak), _sum(w * x * x)
    for i in range(tries):
        scale = divide(-peak, levels + 0.1 * i)
        for _ in range(rounds + 1):
            q = _round_away(x * _inverse(scale)).clamp(-levels, levels - 1)
            scale = _sum(w * x * q) * _inverse(_sum(w * q * q))
        error = _sum(w * (scale * q - x) ** 2)
        better = error < best_error
        best_scale, best_error = torch.where(better, scale, best_scale), torch.minimum(error, best_error)
    return best_scale.squeeze(-1)


def _two_level(scale: Tensor, bits_max: int) -> tuple[Tensor, Tensor]:
    """Sub-block scales [B, S] (>= 0) as a super-block ``d`` [B, 1] (its f16 value) and integers 0..bits_max [B, S]."""
    top = scale.amax(-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, bits_max) / torch.where(top > 0, top, 1.0), 0.0)
    return divide(top, bits_max).half().float(), torch.round(scale * inverse).clamp(0, bits_max)


def _affine_codes(sub: Tensor, step: Tensor, low: Tensor, levels: int) -> Tensor:
    """``sub`` [B, S, n] as codes 0..levels of ``step * q - low`` (``step``, ``low`` [B, S])."""
    step = step.unsqueeze(-1)
    codes = torch.round((sub + low.unsqueeze(-1)) / torch.where(step == 0, 1.0, step)).clamp(0, levels)
    return torch.where(step == 0, 0.0, codes).to(torch.uint8)


def _pack_2bit(q: Tensor) -> Tensor:
    """256 codes < 4 [B, 256] -> 64 bytes [B, 64]: value ``128 h + 32 i + l`` at bits ``2 i`` of byte ``32 h + l``."""
    q = q.reshape(-1, 2, 4, 32).to(torch.int32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).to(torch.uint8).flatten(1)


def _sub_block_weights(sub: Tensor) -> Tensor:
    """llama.cpp's importance of each value in its sub-block's fit: the sub-block's rms plus the value's magnitude."""
    return divide(_sum(sub * sub), sub.shape[-1]).sqrt() + sub.abs()


class Q2_K(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q2_k", "Q2_K", QK_K, 84
    fallback = "q4_0"

    def decode(self, blocks: Tensor) -> Tensor:
        scales, qs = blocks[:, :16], blocks[:, 16:80]
        d, dmin = _f16(blocks[:, 80:82]), _f16(blocks[:, 82:84])
        # each half of 128 values: 32 bytes, 2 bits at shifts 0, 2, 4, 6
        q = _shifted(qs.reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 16, 16).float()
        scale = (d * (scales & 0xF).float()).unsqueeze(-1)
        low = (dmin * (scales >> 4).float()).unsqueeze(-1)
        return (scale * q - low).flatten(1)

    def encode(self, blocks: Tensor) -> Tensor:
        sub = blocks.reshape(-1, 16, 16)
        scale, low = _fit_affine(sub, 3, sub.abs(), -0.5, 0.1, 15)
        (d, scales), (dmin, mins) = _two_level(scale, 15), _two_level(low, 15)
        q = _affine_codes(sub, d * scales, dmin * mins, 3)
        packed_scales = scales.to(torch.uint8) | (mins.to(torch.uint8) << 4)
        return torch.cat([packed_scales, _pack_2bit(q), _half(d), _half(dmin)], dim=-1)


class Q3_K(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q3_k", "Q3_K", QK_K, 110
    fallback = "q4_0"

    def decode(self, blocks: Tensor) -> Tensor:
        hmask, qs, packed, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _f16(blocks[:, 108:110])
        low4 = _shifted(packed[:, :8], [0, 4], 0xF).flatten(1)  # scales 0..7 low nibbles, then 8..15
        high2 = _shifted(packed[:, 8:], [0, 2, 4, 6], 3).flatten(1)  # scale i: bits at (i // 4) * 2 of byte i % 4
        scales = (low4 | (high2 << 4)).float() - 32
        low = _shifted(qs.reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 256)
        high = _bits(hmask, 8)  # bit j of byte l: value 32 j + l
        q = low.float() - 4 * (1 - high.float())  # a clear high bit subtracts 4
        return (d * scales).repeat_interleave(16, dim=1) * q

    def encode(self, blocks: Tensor) -> Tensor:
        sub = blocks.reshape(-1, 16, 16)
        scale = _fit_symmetric(sub, 4, sub * sub)
        # as llama.cpp: the scale of largest magnitude maps to -32
        inverse = -32 * _inverse(_signed_absmax(scale))
        scales = _round_away(scale * inverse).clamp(-32, 31)
        d = _inverse(inverse).half().float()
        step = (d * scales).unsqueeze(-1)
        q = (_round_away(sub * _inverse(step)).clamp(-4, 3) + 4).to(torch.uint8).reshape(-1, 256)
        hmask = _pack_bit_planes((q >> 2).reshape(-1, 8, 32))  # bit j of byte l: value 32 j + l
        s = (scales + 32).to(torch.uint8)
        low4 = s[:, :8] | ((s[:, 8:] & 0xF) << 4)
        high2 = (s >> 4).reshape(-1, 4, 4)  # scale i: bits 2 (i // 4) of byte i % 4
        high2 = high2[:, 0] | (high2[:, 1] << 2) | (high2[:, 2] << 4) | (high2[:, 3] << 6)
        return torch.cat([hmask, _pack_2bit(q & 3), low4, high2, _half(d)], dim=-1)


def _k_scales(packed: Tensor) -> tuple[Tensor, Tensor]:
    """The 8 6-bit scales and 8 6-bit mins of Q4_K/Q5_K from their 12 bytes [B, 12]."""
    d, m, both = packed[:, :4], packed[:, 4:8], packed[:, 8:]
    scales = torch.cat([d & 0x3F, (both & 0xF) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _pack_k_scales(scales: Tensor, mins: Tensor) -> Tensor:
    """Inverse of :func:`_k_scales`: integer scales and mins [B, 8] (< 64) -> [B, 12] bytes."""
    sc, mn = scales.to(torch.uint8), mins.to(torch.uint8)
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    return torch.cat([first, second, third], dim=-1)


def _pack_k_nibbles(q: Tensor) -> Tensor:
    """Inverse of :func:`_k_nibbles`: codes < 16 [B, 8, 32] -> 128 bytes [B, 128]."""
    chunks = q.reshape(-1, 4, 2, 32)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).flatten(1)


def _pack_bit_planes(bits: Tensor) -> Tensor:
    """Inverse of :func:`_bits` over 32 bytes: bits [B, 8, 32] -> [B, 32], bit ``j`` of byte ``l`` from ``bits[:, j, l]``."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)[:, None]
    return (bits.to(torch.int32) << shifts).sum(1).to(torch.uint8)


def _k_nibbles(qs: Tensor) -> Tensor:
    """128 bytes -> 256 values in 8 sub-blocks of 32: chunk c of 32 bytes holds sub-block 2c in its
    low nibbles and 2c + 1 in its high ones."""
    return _shifted(qs.reshape(-1, 4, 32), [0, 4], 0xF).reshape(-1, 8, 32)


class Q4_K(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q4_k", "Q4_K", QK_K, 144
    fallback = "q5_0"

    def decode(self, blocks: Tensor) -> Tensor:
        q, scale, low = q4_k_parts(blocks)
        return (scale.unsqueeze(-1) * q.float() - low.unsqueeze(-1)).flatten(1)

    def encode(self, blocks: Tensor) -> Tensor:
        d, dmin, scales, mins, q = _k_fit(blocks, 15, -1.0, 20)
        return torch.cat([_half(d), _half(dmin), _pack_k_scales(scales, mins), _pack_k_nibbles(q)], dim=-1)


def _k_fit(blocks: Tensor, levels: int, rmin: float, steps: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Q4_K's and Q5_K's fit of super-blocks [B, 256]: ``d``, ``dmin`` [B, 1], the 6-bit scales and mins [B, 8] and
    the codes [B, 8, 32] (0..levels) of ``d * scale * q - dmin * min``."""
    sub = blocks.reshape(-1, 8, 32)
    scale, low = _fit_affine(sub, levels, _sub_block_weights(sub), rmin, 0.1, steps)
    (d, scales), (dmin, mins) = _two_level(scale, 63), _two_level(low, 63)
    return d, dmin, scales, mins, _affine_codes(sub, d * scales, dmin * mins, levels)


class Q5_K(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q5_k", "Q5_K", QK_K, 176
    fallback = "q5_1"

    def decode(self, blocks: Tensor) -> Tensor:
        q, scale, low = q5_k_parts(blocks)
        return (scale.unsqueeze(-1) * q.float() - low.unsqueeze(-1)).flatten(1)

    def encode(self, blocks: Tensor) -> Tensor:
        d, dmin, scales, mins, q = _k_fit(blocks, 31, -0.5, 15)
        high = _pack_bit_planes(q >> 4)  # sub-block j: bit j of the 32 bytes
        return torch.cat([_half(d), _half(dmin), _pack_k_scales(scales, mins), high, _pack_k_nibbles(q & 0xF)], dim=-1)


def q4_k_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K blocks [B, 144] as codes ``q`` [B, 8, 32] (0..15) and each sub-block's ``scale`` and ``low`` [B, 8]:
    a value is ``scale * q - low``."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    return _k_nibbles(blocks[:, 16:]), d * scales, dmin * mins


def q5_k_parts(blocks: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q5_K blocks [B, 176] as codes ``q`` [B, 8, 32] (0..31) and each sub-block's ``scale`` and ``low`` [B, 8]:
    a value is ``scale * q - low``."""
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    scales, mins = _k_scales(blocks[:, 4:16])
    high = _shifted(blocks[:, 16:48], list(range(8)), 1)  # sub-block j: bit j of the 32 bytes
    return _k_nibbles(blocks[:, 48:]) | (high << 4), d * scales, dmin * mins


class Q6_K(GGUFBlockFormat):
    name, ggml_type, block_values, block_bytes = "q6_k", "Q6_K", QK_K, 210
    fallback = "q8_0"

    def decode(self, blocks: Tensor) -> Tensor:
        q, scale = q6_k_parts(blocks)
        return (scale.unsqueeze(-1) * q.float()).flatten(1)

    def encode(self, blocks: Tensor) -> Tensor:
        """llama.cpp's ``quantize_row_q6_K_ref``: each sub-block's scale searched (:func:`_symmetric_scale`), the
        super-block's ``d`` from the scale of largest magnitude (its code -128), then every value coded again
        against its sub-block's scale as stored."""
        sub = blocks.reshape(-1, 16, 16)
        scale, codes = _symmetric_scale(sub.reshape(-1, 16), 32)
        scale, codes = scale.reshape(-1, 16), codes.reshape(-1, 16, 16)
        largest = _signed_absmax(scale)
        iscale = torch.where(largest.abs() < GROUP_MAX_EPS, 0.0, -128 / largest)
        d = torch.where(iscale == 0, 0.0, 1 / iscale).half().float()
        scales = torch.round(iscale * scale).clamp(max=127)
        step = (d * scales).unsqueeze(-1)
        recoded = torch.round(sub / step).clamp(-32, 31) + 32
        q = torch.where(step == 0, codes, recoded).to(torch.uint8).reshape(-1, 2, 4, 32)
        # half h holds values 128 h + 32 i + l: low nibbles of i = 0, 1 / 2, 3 share bytes; high bits of all four
        low = q & 0xF
        low_bytes = (low[:, :, :2] | (low[:, :, 2:] << 4)).flatten(1)
        high = (q >> 4).to(torch.int32)
        high_bytes = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).to(
            torch.uint8
        )
        scale_bytes = scales.to(torch.int8).view(torch.uint8)
        return torch.cat([low_bytes, high_bytes.flatten(1), scale_bytes, _half(d)], dim=-1)


GROUP_MAX_EPS = 1e-15  # llama.cpp's: a group whose largest magnitude is below it is all zeros


def _symmetric_scale(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """llama.cpp's ``make_qx_quants`` (weights ``x**2``) for each row of ``x`` [N, n]: codes ``l + nmax``, ``l`` in
    [-nmax, nmax), and the least-squares scale, the best of the roundings at ``-(nmax + i/10) / max`` for i in -9..9
    (``max``: the value of largest magnitude), as ``sum(l x w)**2 / sum(l l w)``; rows below GROUP_MAX_EPS: 0, codes
    0. Rounded half to even (its ``nearest_int``) and compared in its order, so that the choices are its own."""
    largest = _signed_absmax(x)
    zero = largest.abs() < GROUP_MAX_EPS
    weights = x * x
    weighted = weights * x

    def iscale(i: int) -> Tensor:
        return -(nmax + torch.tensor(0.1, dtype=torch.float32) * i) / torch.where(zero, 1.0, largest)

    def levels(inverse_scale: Tensor) -> Tensor:
        return torch.mul(x, inverse_scale).round_().clamp_(-nmax, nmax - 1)

    def sums(inverse_scale: Tensor) -> tuple[Tensor, Tensor]:  # (summed alike on every device: the same choices)
        at = levels(inverse_scale)
        return _sum(weighted * at), _sum(weights * at * at)

    chosen = iscale(0)
    sum_lx, sum_l2 = sums(chosen)  # the first rounding: its scale whatever it scores
    scale = torch.where(sum_l2 > 0, sum_lx / sum_l2, 0.0)
    best = scale * sum_lx
    for i in (*range(-9, 0), *range(1, 10)):
        candidate = iscale(i)
        sum_lx, sum_l2 = sums(candidate)
        better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
        scale = torch.where(better, sum_lx / sum_l2, scale)
        best = torch.where(better, scale * sum_lx, best)
        chosen = torch.where(better, candidate, chosen)
    return torch.where(zero, 0.0, scale).squeeze(-1), torch.where(zero, 0.0, levels(chosen) + nmax)


def q6_k_parts(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """Q6_K blocks [B, 210] as codes ``q`` [B, 16, 16] (-32..31) and each sub-block's ``scale`` [B, 16]: a value
    is ``scale * q``."""
    low = _shifted(blocks[:, :128].reshape(-1, 2, 64), [0, 4], 0xF).reshape(-1, 8, 32)
    high = _shifted(blocks[:, 128:192].reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 8, 32)
    q = (low | (high << 4)).reshape(-1, 16, 16).to(torch.int32) - 32
    return q, _f16(blocks[:, 208:210]) * blocks[:, 192:208].view(torch.int8).float()


GGUF_FORMATS: tuple[type[GGUFBlockFormat], ...] = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)
"""The block formats GGUF weights stay packed in (named as the ggml type, in lower case)."""
