"""Scalar codes on per-(token, head) absmax scales, and dense bit packing.

A vector ``x`` [..., D] is stored as integer codes plus one f32 scale. ``n``-level
uniform codes map ``[-absmax, absmax]`` onto ``0 .. n-1`` with the midpoint at
``(n-1)/2``: 255 levels (8 bits, one per byte) or 16 levels (4 bits, two per byte);
3-bit codes pack eight per three bytes (:func:`pack3`). fp8 stores ``x / (absmax / 448)``
as e4m3 so the largest entry lands on the largest finite e4m3 value.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0
TINY = 1e-12  # keeps an all-zero vector's scale nonzero


def absmax(x: Tensor) -> Tensor:
    return x.float().abs().amax(dim=-1).clamp_min(TINY)


def rms(x: Tensor) -> Tensor:
    return x.float().pow(2).mean(dim=-1).sqrt().clamp_min(TINY)


def uniform_encode(x: Tensor, scale: Tensor, levels: int) -> Tensor:
    half = (levels - 1) / 2
    codes = torch.round(x.float() / scale.unsqueeze(-1) * half + half)
    return codes.clamp(0, levels - 1).to(torch.uint8)


def uniform_decode(codes: Tensor, scale: Tensor, levels: int) -> Tensor:
    half = (levels - 1) / 2
    return (codes.float() - half) * (scale.unsqueeze(-1) / half)


def fp8_encode(x: Tensor, scale: Tensor) -> Tensor:
    """e4m3 bits as uint8 (uint8 storage keeps the cache indexable on every device)."""
    scaled = (x.float() / (scale.unsqueeze(-1) / FP8_MAX)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def fp8_decode(bits: Tensor, scale: Tensor) -> Tensor:
    return bits.view(torch.float8_e4m3fn).float() * (scale.unsqueeze(-1) / FP8_MAX)


def pack4(codes: Tensor) -> Tensor:
    """[..., D] codes < 16 -> [..., D/2] bytes; byte j holds element j in its low and
    element D/2 + j in its high nibble (a reader gets each half of the vector from one
    nibble of every byte, with no interleaving)."""
    low, high = codes.chunk(2, dim=-1)
    return low | (high << 4)


def unpack4(packed: Tensor) -> Tensor:
    return torch.cat((packed & 0xF, packed >> 4), dim=-1)


def pack3(codes: Tensor) -> Tensor:
    """[..., D] codes < 8 -> [..., 3D/8] bytes in two planes: D/4 bytes of the low two
    bits, byte i holding dims i, D/4 + i, D/2 + i, 3D/4 + i at bits 0, 2, 4, 6; then D/8
    bytes of the high bit, byte i holding dims i + kD/8 at bit k. A reader holding a
    vector as halves gets each column's two codes from one byte of each plane, with
    shifts that depend only on the column (no bits cross a byte)."""
    c = codes.int()
    quarters = (c & 3).unflatten(-1, (4, -1))  # [..., 4, D/4]
    low = sum(quarters[..., q, :] << (2 * q) for q in range(4))
    eighths = (c >> 2).unflatten(-1, (8, -1))  # [..., 8, D/8]
    high = sum(eighths[..., k, :] << k for k in range(8))
    return torch.cat((low, high), dim=-1).to(torch.uint8)


def unpack3(packed: Tensor) -> Tensor:
    p = packed.int()
    quarter = p.shape[-1] * 2 // 3  # D/4
    low, high = p[..., :quarter], p[..., quarter:]
    low_bits = torch.cat([(low >> (2 * q)) & 3 for q in range(4)], dim=-1)
    high_bits = torch.cat([(high >> k) & 1 for k in range(8)], dim=-1)
    return (low_bits | high_bits << 2).to(torch.uint8)
