"""Decoding GGUF (llama.cpp) weight blocks in registers, the part every packed-weight
kernel shares (:mod:`xinfer_cuda.kernels.quant_linear`, :mod:`xinfer_cuda.kernels.quant_moe`).

A packed weight [N, K] is stored as llama.cpp stores it: each row its ``K / qk`` blocks
in order, ``nbytes`` bytes each, as a uint8 tensor [N, K / qk * nbytes]. The layouts are
llama.cpp's (ggml-common.h; ``gguf.quants`` in Python is the reference the tests use).

A block's values are not stored in K order: a 4-bit format keeps value ``j`` in the low
nibble and value ``j + 16`` in the high nibble of the same byte, the K-quants spread a
block's bits over planes. Rather than shuffling the decoded values back into K order,
the kernels bring the activations into the block's order: a block of ``qk`` values is
``groups`` groups of ``parts`` parts of ``span`` values each, value ``j`` of part ``p``
of group ``g`` being column ``g * parts * span + p * span + j`` of the block, and a part
is what one byte range decodes to under one shift. :func:`decode_part` decodes part ``P``
of a tile of groups, [BLOCK_N, U, span], from the quant bytes read once per part as
contiguous runs; a kernel multiplies it with the activations gathered at those columns.

Every formula reads the bytes at the offsets given in the format's comment; scales are
fp16 (read through an fp16 pointer: every scale of every format sits at an even offset),
sub-block scales 4, 6 or 8 bits.

Three block formats here are not GGUF's: ``FP8`` (:mod:`xinfer.quant.fp8_format`), a float32 scale
then 128 e4m3 codes, and ``MXFP4`` and ``NVFP4`` (:mod:`xinfer.quant.fp4_formats`), e2m1 codes under
e8m0 or e4m3 scales, all decoded with integer operations (no FP8 or FP4 hardware needed: SM70 and up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class BlockFormat:
    """A GGUF block type: ``qk`` values in ``nbytes`` bytes, decoded as ``groups`` x
    ``parts`` runs of ``span`` values (see the module docstring)."""

    name: str
    qk: int
    nbytes: int
    groups: int
    parts: int
    f16_offsets: tuple[int, ...]  # of the block's fp16 fields (scales and mins)
    f32_offsets: tuple[int, ...] = ()  # of its float32 fields

    @property
    def span(self) -> int:
        return self.qk // (self.groups * self.parts)

    def row_bytes(self, k: int) -> int:
        """Bytes of a row of ``k`` values."""
        if k % self.qk:
            raise ValueError(f"{self.name}: a row of {k} values is not a whole number of {self.qk}-value blocks")
        return k // self.qk * self.nbytes


FORMATS: dict[str, BlockFormat] = {
    f.name: f
    for f in (
        BlockFormat("Q8_0", 32, 34, 1, 1, (0,)),
        BlockFormat("Q4_0", 32, 18, 1, 2, (0,)),
        BlockFormat("Q4_1", 32, 20, 1, 2, (0, 2)),
        BlockFormat("Q5_0", 32, 22, 1, 2, (0,)),
        BlockFormat("Q5_1", 32, 24, 1, 2, (0, 2)),
        BlockFormat("Q2_K", 256, 84, 2, 4, (80, 82)),
        BlockFormat("Q3_K", 256, 110, 2, 4, (108,)),
        BlockFormat("Q4_K", 256, 144, 4, 2, (0, 2)),
        BlockFormat("Q5_K", 256, 176, 4, 2, (0, 2)),
        BlockFormat("Q6_K", 256, 210, 2, 4, (208,)),
        BlockFormat("FP8", 128, 132, 4, 1, (), (0,)),
        BlockFormat("MXFP4", 32, 17, 1, 2, ()),
        BlockFormat("NVFP4", 128, 76, 8, 2, (), (0,)),
    )
}


def random_packed(n: int, k: int, fmt: BlockFormat, scale: float = 1e-3, device: torch.device | str = "cpu") -> Tensor:
    """A weight [n, k] in ``fmt``'s blocks, uint8 [n, k / qk * nbytes]: random bytes with
    finite fp16 scales and mins of magnitude ``scale`` (random bytes there would give NaN
    and inf), what the kernel tests and benchmarks run on."""
    blocks = torch.randint(0, 256, (n, k // fmt.qk, fmt.nbytes), dtype=torch.uint8, device=device)
    for offset in fmt.f16_offsets:
        halves = (torch.rand(n, k // fmt.qk, device=device) * 0.75 + 0.25) * scale
        blocks[..., offset : offset + 2] = halves.half().view(torch.uint8).view(n, k // fmt.qk, 2)
    for offset in fmt.f32_offsets:
        singles = (torch.rand(n, k // fmt.qk, device=device) * 0.75 + 0.25) * scale
        blocks[..., offset : offset + 4] = singles.view(torch.uint8).view(n, k // fmt.qk, 4)
    if fmt.name == "FP8":  # e4m3 has no infinities; S.1111.111 is NaN
        codes = blocks[..., 4:]
        codes[(codes & 0x7F) == 0x7F] = 0
    if fmt.name == "MXFP4":  # e8m0 scales of 2**-10 .. 2**0 (0 and 255 are not weights' scales)
        blocks[..., 0] = torch.randint(117, 128, blocks.shape[:-1], dtype=torch.uint8, device=device)
    if fmt.name == "NVFP4":  # e4m3 scales, NaN left out
        scales = blocks[..., 4:12]
        scales[(scales & 0x7F) == 0x7F] = 0
    return blocks.view(n, fmt.row_bytes(k))


@triton.jit
def _load(ptr, mask):
    # (an else, not an early return: Triton's GPU frontend, 3.6 as 3.9, also lowers what follows a return in
    # a constexpr if, here a load with `other` and no mask, which it rejects; the interpreter stops at the return)
    if mask is None:  # tiles that no row or block end cuts
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def _byte(ptr, mask):
    return _load(ptr, mask).to(tl.int32)


@triton.jit
def _half(ptr, mask):
    return _load(ptr.to(tl.pointer_type(tl.float16)), mask).to(tl.float32)


@triton.jit
def _int8(ptr, mask):
    return _load(ptr, mask).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _single(ptr, mask):
    return _load(ptr.to(tl.pointer_type(tl.float32)), mask)


@triton.jit
def _e4m3(byte):
    """e4m3 codes (int32 bytes) as fp32, by integer operations: the sign and the 7 bits of exponent and
    mantissa moved into an fp16's places are the fp16 of the value times 2**-8 (bias 15 for 7),
    subnormals included."""
    bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) as fp32, by integer operations: the sign, and the exponent and mantissa bits
    moved into an fp16's lowest exponent and highest mantissa bits, make the fp16 of the value times 2**-14
    (bias 15 for 1; the zero exponent's 0.5 is fp16's subnormal 2**-15)."""
    bits = ((code & 8) << 12) | ((code & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e8m0(byte):
    """e8m0 scale bytes (int32) as fp32 powers of two: the byte is the float32's exponent field (so 0, 2**-127,
    a subnormal, decodes as 0; 255 is NaN in e8m0 and no weight's scale)."""
    return (byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_min_k4(scales, i, mask):
    """The 6-bit scale and min of sub-block ``i`` (0..7) of a Q4_K/Q5_K block from its 12
    scale bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins),
    4-7 in the nibbles of bytes 8-11 with their top two bits in bytes 0-7's top bits."""
    lo = i < 4
    b_i = _byte(scales + i, mask)
    b_i4 = _byte(scales + i + 4, mask)
    b_im4 = _byte(scales + tl.where(lo, i, i - 4), mask)
    sc = tl.where(lo, b_i & 63, (b_i4 & 15) | ((b_im4 >> 6) << 4))
    mn = tl.where(lo, b_i4 & 63, (b_i4 >> 4) | ((b_i >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def decode_part(FMT: tl.constexpr, block, g, P: tl.constexpr, j, mask):
    """Part ``P`` of groups ``g`` of the blocks starting at ``block`` as fp32 values:
    ``block`` [BLOCK_N, U, 1] uint8 pointers, ``g`` [1, U, 1] the group within its block,
    ``j`` [1, 1, span] the value within the part, ``mask`` [BLOCK_N, U, 1] or None."""
    if FMT == "Q8_0":  # d f16 @0, qs i8[32] @2
        return _half(block, mask) * _int8(block + 2 + j, mask)
    elif FMT == "FP8":  # scale f32 @0, e4m3[128] @4 (group g: values 32g..)
        return _single(block, mask) * _e4m3(_byte(block + 4 + g * 32 + j, mask))
    elif FMT == "MXFP4":  # e8m0 scale @0, qs[16] @1: value j low nibble, j + 16 high
        return _e8m0(_byte(block, mask)) * _e2m1((_byte(block + 1 + j, mask) >> (4 * P)) & 15)
    elif FMT == "NVFP4":
        # tensor scale f32 @0, e4m3 scales[8] @4 (group g: values 16g..), qs[64] @12 (group g: bytes 8g..,
        # part p: nibble p, values 16g + 8p + j); code * e4m3 * tensor scale, the scale decoded once a group
        scale = _e4m3(_byte(block + 4 + g, mask)) * _single(block, mask)
        return scale * _e2m1((_byte(block + 12 + g * 8 + j, mask) >> (4 * P)) & 15)
    elif FMT == "FP8_CVT":  # FP8 through the hardware's e4m3 conversion (SM89 and up)
        codes = _load(block + 4 + g * 32 + j, mask).to(tl.float8e4nv, bitcast=True)
        return _single(block, mask) * codes.to(tl.float32)
    elif FMT == "Q4_0":  # d @0, qs[16] @2: value j low nibble, j + 16 high; q - 8
        q = (_byte(block + 2 + j, mask) >> (4 * P)) & 15
        return _half(block, mask) * (q - 8).to(tl.float32)
    elif FMT == "Q4_1":  # d @0, m @2, qs[16] @4; d q + m
        q = (_byte(block + 4 + j, mask) >> (4 * P)) & 15
        return _half(block, mask) * q.to(tl.float32) + _half(block + 2, mask)
    elif FMT == "Q5_0":  # d @0, qh u32 @2 (bit i: fifth bit of value i), qs[16] @6; q - 16
        bit = 16 * P + j
        hi = (_byte(block + 2 + bit // 8, mask) >> (bit % 8)) & 1
        q = ((_byte(block + 6 + j, mask) >> (4 * P)) & 15) | (hi << 4)
        return _half(block, mask) * (q - 16).to(tl.float32)
    elif FMT == "Q5_1":  # d @0, m @2, qh @4, qs[16] @8; d q + m
        bit = 16 * P + j
        hi = (_byte(block + 4 + bit // 8, mask) >> (bit % 8)) & 1
        q = ((_byte(block + 8 + j, mask) >> (4 * P)) & 15) | (hi << 4)
        return _half(block, mask) * q.to(tl.float32) + _half(block + 2, mask)
    elif FMT == "Q2_K":
        # scales[16] @0 (sub-block of 16: low nibble scale, high nibble min), qs[64] @16
        # (group g: bytes g*32.., part p: bits 2p), d @80, dmin @82
        q = (_byte(block + 16 + g * 32 + j, mask) >> (2 * P)) & 3
        sc = _byte(block + g * 8 + P * 2 + j // 16, mask)
        d, dmin = _half(block + 80, mask), _half(block + 82, mask)
        return d * (sc & 15).to(tl.float32) * q.to(tl.float32) - dmin * (sc >> 4).to(tl.float32)
    elif FMT == "Q3_K":
        # hmask[32] @0 (bit 4g + p of byte j: the value is NOT lowered by 4), qs[64] @32 as
        # Q2_K's, scales[12] @96 (16 signed 6-bit: low nibbles in bytes 0-7, top two bits in
        # 8-11), d @108
        low = (_byte(block + 32 + g * 32 + j, mask) >> (2 * P)) & 3
        high = (_byte(block + j, mask) >> (g * 4 + P)) & 1
        q = low - 4 * (1 - high)
        i = g * 8 + P * 2 + j // 16
        s_lo = (_byte(block + 96 + i % 8, mask) >> (4 * (i // 8))) & 15
        s_hi = (_byte(block + 104 + i % 4, mask) >> (2 * (i // 4))) & 3
        s = (s_lo | (s_hi << 4)) - 32
        return _half(block + 108, mask) * s.to(tl.float32) * q.to(tl.float32)
    elif FMT == "Q4_K":
        # d @0, dmin @2, scales[12] @4 (8 sub-blocks of 32: 6-bit scale and min), qs[128] @16
        # (group g: bytes g*32.., part p: nibble p; sub-block 2g + p); d sc q - dmin m
        q = (_byte(block + 16 + g * 32 + j, mask) >> (4 * P)) & 15
        sc, mn = _scale_min_k4(block + 4, 2 * g + P, mask)
        return _half(block, mask) * sc * q.to(tl.float32) - _half(block + 2, mask) * mn
    elif FMT == "Q5_K":  # Q4_K's with qh[32] @16 (bit 2g + p of byte j: the fifth bit), qs @48
        q = (_byte(block + 48 + g * 32 + j, mask) >> (4 * P)) & 15
        q |= ((_byte(block + 16 + j, mask) >> (2 * g + P)) & 1) << 4
        sc, mn = _scale_min_k4(block + 4, 2 * g + P, mask)
        return _half(block, mask) * sc * q.to(tl.float32) - _half(block + 2, mask) * mn
    else:
        tl.static_assert(FMT == "Q6_K", "unknown GGUF block format")
        # ql[128] @0 (group g: bytes g*64.., part p: bytes +32 (p % 2), nibble p // 2),
        # qh[64] @128 (group g: bytes g*32.., part p: bits 2p), scales i8[16] @192 (sub-block
        # of 16), d @208; d s (q - 32)
        low = (_byte(block + g * 64 + (P % 2) * 32 + j, mask) >> (4 * (P // 2))) & 15
        high = (_byte(block + 128 + g * 32 + j, mask) >> (2 * P)) & 3
        q = (low | (high << 4)) - 32
        s = _int8(block + 192 + g * 8 + P * 2 + j // 16, mask)
        return _half(block + 208, mask) * s * q.to(tl.float32)
