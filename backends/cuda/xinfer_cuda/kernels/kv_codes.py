"""The KV formats' codes in Triton: how one side (K or V) of a quantized cache is
encoded at write time and decoded in registers inside attention.

Mirrors ``xinfer.kv.codecs`` (the reference) exactly: same scales, same rounding
(half to even), same bit order (``xinfer.kv.codes``: a 4-bit byte j holds dims j and
D/2 + j; 3-bit codes lie in a plane of their low two bits and one of their high bit).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer.kv.codecs import GAUSSIAN_LEVELS, Codec, Fp8, LloydMax, Plain, Uniform
from xinfer.kv.codes import FP8_MAX, TINY
from xinfer_cuda.kernels.shared import FP8_MAX_C, fp8_value

PLAIN, FP8, UNIFORM, LLOYD = range(4)
CODE_PLAIN: tl.constexpr = tl.constexpr(PLAIN)
CODE_FP8: tl.constexpr = tl.constexpr(FP8)
CODE_UNIFORM: tl.constexpr = tl.constexpr(UNIFORM)
CODE_LLOYD: tl.constexpr = tl.constexpr(LLOYD)

# How attention turns stored codes into fp16 numbers: with portable Triton bit
# operations (the interpreter, any GPU); with PTX that decodes a 32-bit word of packed
# nibbles at a time (a GPU); and also e4m3 through the hardware conversion (sm_89+).
PORTABLE, PTX, PTX_FP8 = range(3)
DECODE_PTX: tl.constexpr = tl.constexpr(PTX)
DECODE_PTX_FP8: tl.constexpr = tl.constexpr(PTX_FP8)


@functools.cache
def decode_method(device: torch.device) -> int:
    """The decode method for ``device`` (asked once per device, not per attention call)."""
    if device.type != "cuda":
        return PORTABLE
    return gpu_decode_method(torch.cuda.get_device_capability(device))


def gpu_decode_method(capability: tuple[int, int]) -> int:
    return PTX_FP8 if capability >= (8, 9) else PTX


@dataclass(frozen=True)
class Side:
    """One side of a layer's cache as the kernels see it."""

    data: Tensor  # [num_blocks, block_size, Hkv, D or packed bytes]
    scale: Tensor | None  # [num_blocks, block_size, Hkv] f32
    levels: Tensor | None  # Lloyd–Max levels, ascending (CODE_LLOYD only)
    code: int  # PLAIN, FP8, UNIFORM or LLOYD
    bits: int = 8
    num_levels: int = 0
    rms_clip: float = 0.0  # the per-row scale: rms_clip * RMS, or the absmax where 0

    def scale_or_data(self) -> Tensor:
        return self.scale if self.scale is not None else self.data

    def levels_or_data(self) -> Tensor:
        return self.levels if self.levels is not None else self.data

    def read_as(self, magic: bool, decode: int = PORTABLE) -> tuple[float, float]:
        """(offset, step) with value = (tile - offset) * step * per-row scale, for the
        tile :func:`load_stored` returns (``magic``: codes built as fp16 MAGIC + code;
        ``decode``: the decode method)."""
        if self.code == UNIFORM:
            half = (self.num_levels - 1) / 2
            return half + (MAGIC_VALUE if magic else 0.0), 1 / half
        if self.code == FP8:
            if magic and decode == PTX_FP8:
                return 0.0, 1 / FP8_MAX  # tiles hold e4m3 values
            return 0.0, 256 / FP8_MAX  # tiles hold e4m3 / 256
        return 0.0, 1.0

    def constexprs(self, prefix: str, magic: bool, decode: int = PORTABLE) -> dict:
        """How attention reads this side."""
        offset, step = self.read_as(magic, decode)
        return {
            f"{prefix}_CODE": self.code,
            f"{prefix}_BITS": self.bits,
            f"{prefix}_OFFSET": offset,
            f"{prefix}_STEP": step,
        }


def side(cache: LayerKVCache, name: str, codec: Codec) -> Side:
    data, scale = cache[name], cache.tensors.get(name + "_scale")
    if isinstance(codec, LloydMax):
        return Side(data, scale, _levels(codec.levels, data.device), LLOYD, codec.bits, codec.levels, 1.0)
    if isinstance(codec, Uniform):
        return Side(data, scale, None, UNIFORM, codec.bits, codec.levels, codec.rms_clip or 0.0)
    if isinstance(codec, Fp8):
        return Side(data, scale, None, FP8)
    if isinstance(codec, Plain):
        return Side(data, None, None, PLAIN)
    raise NotImplementedError(f"no Triton code for {type(codec).__name__}")


@functools.cache
def _levels(num_levels: int, device: torch.device) -> Tensor:
    half = torch.tensor(GAUSSIAN_LEVELS[num_levels])
    return torch.cat((-half.flip(0), half)).to(device)


TINY_C: tl.constexpr = tl.constexpr(TINY)
# fp16 bits 0x6400 are 1024 with a 10-bit mantissa of zeros: OR-ing in a code c < 1024
# gives the fp16 number 1024 + c, so codes become numbers without a conversion.
MAGIC_BITS: tl.constexpr = tl.constexpr(0x6400)
MAGIC_VALUE = 1024.0


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
def _as_number(codes, DTYPE: tl.constexpr):
    """Integer codes as ``DTYPE`` numbers: fp16 MAGIC + code (bit operations only), or
    the code itself in fp32."""
    if DTYPE == tl.float16:
        number = (codes.to(tl.int16) | MAGIC_BITS).to(tl.float16, bitcast=True)
    else:
        number = codes.to(DTYPE)
    return number


@triton.jit
def vector_scale(x, HEAD_DIM: tl.constexpr, RMS_CLIP: tl.constexpr):
    """Per-row scale of x [rows, D] (zeros past HEAD_DIM): RMS_CLIP times the RMS (1 for
    Lloyd–Max levels), or the absmax where RMS_CLIP is 0."""
    if RMS_CLIP > 0.0:
        return tl.maximum(tl.sqrt(tl.sum(x * x, 1) / HEAD_DIM), TINY_C) * RMS_CLIP
    return tl.maximum(tl.max(tl.abs(x), 1), TINY_C)


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
def half_columns(HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, HALF_D: tl.constexpr):
    """Columns of the halves attention holds a row in, and which of them hold
    dimensions: half 0 is dims [0, SPLIT), half 1 is [SPLIT, 2 SPLIT), each padded to
    HALF_D (>= 16, the narrowest dot) and cut at HEAD_DIM. Caches with 4- or 3-bit
    codes split rows at D/2; the others keep them whole (SPLIT >= HEAD_DIM, so half 1
    is empty and the kernels skip it: ``SPLIT < HEAD_DIM`` is false)."""
    cols = tl.arange(0, HALF_D)
    lo_ok = (cols < SPLIT) & (cols < HEAD_DIM)
    return cols, lo_ok, lo_ok & (SPLIT + cols < HEAD_DIM)


@triton.jit
def load_stored(
    head_ptr,
    levels_ptr,
    row,
    rows_ok,
    ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF_D: tl.constexpr,
    CODE: tl.constexpr,
    BITS: tl.constexpr,
    DTYPE: tl.constexpr,
    DECODE: tl.constexpr,
):
    """The tile of ``ROWS`` rows of one KV head at element offsets ``row`` as two halves
    [ROWS, HALF_D] (:func:`half_columns`; padding reads as code 0; whole rows give the
    first half twice). As stored, before the per-row scale (:meth:`Side.read_as`): a
    plain cache's values as they are; else, in ``DTYPE`` (fp16, or fp32 for fp32 queries), e4m3 values (/ 256 but for the
    hardware conversion), uniform codes (fp16: 1024 + code) or unit Lloyd–Max levels.
    A 4-bit byte holds dim j in its low and dim D/2 + j in its high nibble, so the
    halves come out of one load with no shuffle. Masked rows read as 0."""
    cols, lo_ok, hi_ok = half_columns(HEAD_DIM, SPLIT, HALF_D)
    # One return statement: Triton types every return of a function alike.
    if BITS == 4:
        at = head_ptr + row[:, None] + cols[None, :]
        packed = tl.load(at, mask=rows_ok[:, None] & lo_ok[None, :], other=0)
        if DECODE >= DECODE_PTX and CODE == CODE_UNIFORM and DTYPE == tl.float16:
            lo, hi = _nibble_numbers(packed)  # already numbers
        else:
            packed = packed.to(tl.int16)
            lo = _code_values(packed & 0xF, levels_ptr, CODE, BITS, DTYPE, DECODE)
            hi = _code_values(packed >> 4, levels_ptr, CODE, BITS, DTYPE, DECODE)
    elif BITS == 3:
        # Column c's two codes: the low bit pairs from byte c % (D/4) of the first plane
        # at bit 2q, q = c // (D/4) (+ 4 for the second half), the high bits from byte
        # c % (D/8) of the second at bit k = c // (D/8) (+ 4).
        quarter: tl.constexpr = HEAD_DIM // 4
        eighth: tl.constexpr = HEAD_DIM // 8
        mask = rows_ok[:, None] & lo_ok[None, :]
        low = tl.load(head_ptr + row[:, None] + (cols % quarter)[None, :], mask=mask, other=0)
        high = tl.load(head_ptr + quarter + row[:, None] + (cols % eighth)[None, :], mask=mask, other=0)
        low_shift = 2 * (cols // quarter)
        high_shift = cols // eighth
        # The PTX decode takes each word's four neighbouring columns at one pair of
        # shifts, which they share where D/8 >= 4 (in the layout the compiler gives these
        # tiles: threads hold 16 neighbouring columns).
        if DECODE >= DECODE_PTX and CODE == CODE_UNIFORM and DTYPE == tl.float16 and eighth >= 4:
            shifts = tl.broadcast_to((low_shift | high_shift << 4).to(tl.uint8)[None, :], low.shape)
            lo, hi = _three_bit_numbers(low, high, shifts)
        else:
            low = low.to(tl.int16) >> low_shift[None, :].to(tl.int16)
            high = high.to(tl.int16) >> high_shift[None, :].to(tl.int16)
            lo = _code_values((low & 3) | (high & 1) << 2, levels_ptr, CODE, BITS, DTYPE, DECODE)
            hi = _code_values((low >> 4) & 3 | (high >> 2) & 4, levels_ptr, CODE, BITS, DTYPE, DECODE)
    else:
        at = head_ptr + row[:, None] + cols[None, :]
        lo = tl.load(at, mask=rows_ok[:, None] & lo_ok[None, :], other=0)
        lo = _code_values(lo, levels_ptr, CODE, BITS, DTYPE, DECODE)
        if SPLIT < HEAD_DIM:  # a second half
            hi = tl.load(at + SPLIT, mask=rows_ok[:, None] & hi_ok[None, :], other=0)
            hi = _code_values(hi, levels_ptr, CODE, BITS, DTYPE, DECODE)
        else:
            hi = lo
    return lo, hi


@triton.jit
def _code_values(codes, levels_ptr, CODE: tl.constexpr, BITS: tl.constexpr, DTYPE: tl.constexpr, DECODE: tl.constexpr):
    """Stored codes as the numbers :func:`load_stored` describes."""
    if CODE == CODE_PLAIN:
        tile = codes
    elif CODE == CODE_FP8 and DECODE == DECODE_PTX_FP8 and DTYPE == tl.float16:
        tile = codes.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif CODE == CODE_FP8:
        tile = fp8_value(codes).to(DTYPE)
    elif CODE == CODE_LLOYD:
        tile = _lloyd_level(codes, levels_ptr, BITS, DTYPE)
    else:
        tile = _as_number(codes, DTYPE)
    return tile


@triton.jit
def _nibble_numbers(packed):
    """fp16 numbers 1024 + code of the low and of the high nibbles of uint8 ``packed``
    (two tiles of its shape): per 32-bit word of four bytes, two byte permutes, two
    shifts and four ``lop3`` (``(x & 0x000F000F) | MAGIC``) make eight numbers."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 pair, shifted;
        prmt.b32 pair, $4, 0, 0x4140;
        shr.b32 shifted, pair, 4;
        lop3.b32 $0, pair, 0x000F000F, 0x64006400, 0xea;
        lop3.b32 $2, shifted, 0x000F000F, 0x64006400, 0xea;
        prmt.b32 pair, $4, 0, 0x4342;
        shr.b32 shifted, pair, 4;
        lop3.b32 $1, pair, 0x000F000F, 0x64006400, 0xea;
        lop3.b32 $3, shifted, 0x000F000F, 0x64006400, 0xea;
        }
        """,
        "=r,=r,=r,=r,r",
        [packed],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _three_bit_numbers(low, high, shifts):
    """fp16 numbers 1024 + code of both halves' 3-bit codes (two tiles of the shape of
    uint8 ``low`` and ``high``, the bytes of the two planes each column reads), given
    each column's shifts ``2 q | k << 4`` (:func:`load_stored`). Per word of four
    columns, which share their shifts: the two shifts, eight bit operations to the
    eight codes as bytes, and four byte permutes that put 0x64 above each."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b32 low_shift, high_shift, low, high, bit, lo, hi, magic;
        and.b32 low_shift, $6, 0xF;
        bfe.u32 high_shift, $6, 4, 4;
        shr.b32 low, $4, low_shift;
        shr.b32 high, $5, high_shift;
        shl.b32 bit, high, 2;
        and.b32 bit, bit, 0x04040404;
        lop3.b32 lo, low, 0x03030303, bit, 0xea;
        shr.b32 low, low, 4;
        shr.b32 bit, high, 2;
        and.b32 bit, bit, 0x04040404;
        lop3.b32 hi, low, 0x03030303, bit, 0xea;
        mov.b32 magic, 0x64;
        prmt.b32 $0, lo, magic, 0x4140;
        prmt.b32 $1, lo, magic, 0x4342;
        prmt.b32 $2, hi, magic, 0x4140;
        prmt.b32 $3, hi, magic, 0x4342;
        }
        """,
        "=r,=r,=r,=r,r,r,r",
        [low, high, shifts],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def _lloyd_level(codes, levels_ptr, BITS: tl.constexpr, DTYPE: tl.constexpr):
    """Unit Lloyd–Max levels of ``codes`` by a chain of selects over the level
    magnitudes (the table is symmetric: code half + i is +m_i, code half - 1 - i is
    -m_i); arithmetic instead of a memory gather per element."""
    half: tl.constexpr = 1 << (BITS - 1)
    upper = codes >= half
    index = tl.where(upper, codes - half, half - 1 - codes)
    magnitude = tl.zeros(codes.shape, DTYPE) + tl.load(levels_ptr + half).to(DTYPE)
    for i in tl.static_range(1, half):
        magnitude = tl.where(index == i, tl.load(levels_ptr + half + i).to(DTYPE), magnitude)
    return tl.where(upper, magnitude, -magnitude)


@triton.jit
def load_scale(scale_head_ptr, block, slot, stride_block, stride_slot, rows_ok):
    return tl.load(scale_head_ptr + block * stride_block + slot * stride_slot, mask=rows_ok, other=0.0)
