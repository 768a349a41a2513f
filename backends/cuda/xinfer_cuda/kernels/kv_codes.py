"""The KV formats' codes in Triton: how one side (K or V) of a quantized cache is
encoded at write time and decoded in registers inside attention.

Mirrors ``xinfer.kv.codecs`` (the reference) exactly: same scales, same rounding
(half to even), same bit order. Packed codes come in groups of ``GROUP`` values held
in ``GROUP_BYTES`` little-endian bytes (4-bit: 2 in 1; 3-bit: 8 in 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer.kv.codecs import Codec, Fp8, GAUSSIAN_LEVELS, LloydMax, Plain, Uniform
from xinfer.kv.codes import FP8_MAX, TINY

PLAIN, FP8, UNIFORM, LLOYD = range(4)
CODE_PLAIN: tl.constexpr = tl.constexpr(PLAIN)
CODE_FP8: tl.constexpr = tl.constexpr(FP8)
CODE_UNIFORM: tl.constexpr = tl.constexpr(UNIFORM)
CODE_LLOYD: tl.constexpr = tl.constexpr(LLOYD)


@dataclass(frozen=True)
class Side:
    """One side of a layer's cache as the kernels see it."""

    data: Tensor  # [num_blocks, block_size, Hkv, D or packed bytes]
    scale: Tensor | None  # [num_blocks, block_size, Hkv] f32
    levels: Tensor | None  # Lloyd–Max levels, ascending (CODE_LLOYD only)
    code: int  # PLAIN, FP8, UNIFORM or LLOYD
    bits: int = 8
    num_levels: int = 0

    @property
    def group(self) -> int:
        return {4: 2, 3: 8}.get(self.bits, 1)

    @property
    def group_bytes(self) -> int:
        return self.group * self.bits // 8

    def scale_or_data(self) -> Tensor:
        return self.scale if self.scale is not None else self.data

    def levels_or_data(self) -> Tensor:
        return self.levels if self.levels is not None else self.data

    def constexprs(self, prefix: str) -> dict:
        return {
            f"{prefix}_CODE": self.code,
            f"{prefix}_BITS": self.bits,
            f"{prefix}_LEVELS": self.num_levels,
            f"{prefix}_GROUP": self.group,
            f"{prefix}_GROUP_BYTES": self.group_bytes,
        }


def side(cache: LayerKVCache, name: str, codec: Codec) -> Side:
    data, scale = cache[name], cache.tensors.get(name + "_scale")
    if isinstance(codec, LloydMax):
        return Side(data, scale, _levels(codec.levels, data.device), LLOYD, codec.bits, codec.levels)
    if isinstance(codec, Uniform):
        return Side(data, scale, None, UNIFORM, codec.bits, codec.levels)
    if isinstance(codec, Fp8):
        return Side(data, scale, None, FP8)
    if isinstance(codec, Plain):
        return Side(data, None, None, PLAIN)
    raise NotImplementedError(f"no Triton code for {type(codec).__name__}")


_LEVEL_CACHE: dict[tuple[int, torch.device], Tensor] = {}


def _levels(num_levels: int, device: torch.device) -> Tensor:
    key = (num_levels, device)
    if key not in _LEVEL_CACHE:
        half = torch.tensor(GAUSSIAN_LEVELS[num_levels])
        _LEVEL_CACHE[key] = torch.cat((-half.flip(0), half)).to(device)
    return _LEVEL_CACHE[key]


FP8_MAX_C: tl.constexpr = tl.constexpr(FP8_MAX)
TINY_C: tl.constexpr = tl.constexpr(TINY)


@triton.jit
def round_half_even(y):
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where((r - y == 0.5) & odd, r - 1.0, r)


@triton.jit
def fp8_bits(y):
    """e4m3fn bits (as int32) of ``y`` in [-448, 448], rounded half to even; exact on
    every GPU (no fp8 hardware needed)."""
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals share the quantum of 2**-9
    q = round_half_even(a * tl.exp2((3 - exponent).to(tl.float32)))
    bits = exponent * 8 + q.to(tl.int32) + 48
    return tl.where(y < 0, bits | 0x80, bits)


@triton.jit
def fp8_value(bits):
    """e4m3fn bits -> value / 256: the bits moved into an fp16 (same mantissa, the
    exponent bias differs by 8)."""
    b = bits.to(tl.int16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def vector_scale(x, CODE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Per-row scale of x [rows, D] (zeros past HEAD_DIM): RMS for Lloyd–Max, else absmax."""
    if CODE == CODE_LLOYD:
        s = tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM)
    else:
        s = tl.max(tl.abs(x), 1)
    return tl.maximum(s, TINY_C)


@triton.jit
def encode(x, scale, levels_ptr, CODE: tl.constexpr, LEVELS: tl.constexpr):
    """Codes (int32) of x [rows, n] on per-row ``scale`` [rows]."""
    if CODE == CODE_FP8:
        y = tl.minimum(tl.maximum(x / (scale[:, None] / FP8_MAX_C), -FP8_MAX_C), FP8_MAX_C)
        return fp8_bits(y)
    elif CODE == CODE_UNIFORM:
        half: tl.constexpr = (LEVELS - 1) / 2
        c = round_half_even(x / scale[:, None] * half + half)
        return tl.minimum(tl.maximum(c, 0.0), LEVELS - 1).to(tl.int32)
    else:
        y = x / scale[:, None]
        c = tl.zeros(x.shape, tl.int32)
        for i in tl.static_range(LEVELS - 1):
            bound = (tl.load(levels_ptr + i) + tl.load(levels_ptr + i + 1)) / 2
            c += (y > bound).to(tl.int32)
        return c


@triton.jit
def load_tile(
    head_ptr,
    scale_head_ptr,
    levels_ptr,
    block,
    slot,
    stride_block,
    stride_slot,
    stride_s_block,
    stride_s_slot,
    rows_ok,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CODE: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
):
    """The [rows, BLOCK_D] tile of one KV head at cache positions (block, slot), decoded
    in registers (fp32 for quantized codes, the cache dtype for plain). Masked rows and
    dims read as 0."""
    dims = tl.arange(0, BLOCK_D)
    mask = rows_ok[:, None] & (dims < HEAD_DIM)[None, :]
    row = block * stride_block + slot * stride_slot
    if CODE == CODE_PLAIN:
        return tl.load(head_ptr + row[:, None] + dims[None, :], mask=mask, other=0.0)
    scale = tl.load(scale_head_ptr + block * stride_s_block + slot * stride_s_slot, mask=rows_ok, other=0.0)
    if CODE == CODE_FP8:
        bits = tl.load(head_ptr + row[:, None] + dims[None, :], mask=mask, other=0)
        return fp8_value(bits) * (scale * (256.0 / FP8_MAX_C))[:, None]
    first_byte = row[:, None] + (dims // GROUP * GROUP_BYTES)[None, :]
    word = tl.zeros([rows_ok.shape[0], BLOCK_D], tl.int32)
    for b in tl.static_range(GROUP_BYTES):
        word |= tl.load(head_ptr + first_byte + b, mask=mask, other=0).to(tl.int32) << (8 * b)
    code = (word >> (BITS * (dims % GROUP))[None, :]) & ((1 << BITS) - 1)
    if CODE == CODE_UNIFORM:
        half: tl.constexpr = (LEVELS - 1) / 2
        return (code.to(tl.float32) - half) * (scale / half)[:, None]
    else:
        return tl.load(levels_ptr + code) * scale[:, None]
