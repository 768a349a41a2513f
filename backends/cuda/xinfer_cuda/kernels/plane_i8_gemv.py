"""One row of ``x`` times a GGUF weight in planes with 8-bit integer products: batch-1 decode as llama.cpp's MMVQ
does it, four products an instruction (``dp4a``) where :func:`~xinfer_cuda.kernels.plane_linear.plane_gemv` spends
about six instructions a value turning codes into floats.

The activations are quantized per block of 32 columns (:func:`~xinfer_cuda.kernels.plane_i8_dot.quantize_blocks`,
``x ~ d_x q_x``) and stored in the order this kernel reads them. A block's sum is then

    sum over the block of x w = d_x * scale * (q_x . code) + s_x * bias   (up to x's rounding to q_x),

with ``value = scale * code + bias`` per (weight row, block) and ``s_x`` the block's exact sum; a symmetric type's
codes are taken less the code of 0 (Q8_0's 128, Q6_K's 32, Q5_0's 16, Q4_0's 8), so its blocks add nothing.

``dp4a`` sums the products of four bytes: they must be four codes of one block. A thread reads 16 bytes of a row's
codes (words ``w .. w + 3`` of half ``h`` of a tile, ``w = 16 h + 4 c``). In a tile of nibbles (8 fields) byte ``j``
of word ``w`` holds the codes of columns ``64 j + 2 w`` and ``64 j + 2 w + 1``, so byte ``j`` of the four words,
gathered into one word (a 4x4 byte transpose, eight ``prmt``), is 8 codes of block ``2 j + h``: its low nibbles
(the even columns) and its high nibbles (the odd ones) are two ``dp4a`` with the matching activation words. In a
tile of bytes (Q8_0, 4 fields) words ``w`` and ``w + 1`` hold columns ``2 w .. 2 w + 3`` in their low halves and
``64 + 2 w ..`` in their high halves: one ``prmt`` each. Q5's and Q6_K's high bits join the nibbles as bytes
(Q6_K's high halves of the four words regathered byte by byte first).

A thread holds a half tile (4 loads) of ``R`` rows: the products of a block (Q6_K: of a sub-block of 16) are summed
as integers in the thread, then scaled once; the threads of a warp are 16 tiles' halves, the warps rows. The first
step's code words are loaded before the wait on the kernel that quantizes the activations, so that they overlap it.
Under the Triton interpreter, which runs no PTX, the byte permutes and ``dp4a`` are computed from shifts and masks.

In the sm_90 build that is about 2 SASS instructions a Q4_K or Q8_0 value and 3.6 a Q6_K one (the float GEMV: 6.0,
5.5 and 9). On an H100 (``quant_decode.py --tiles --batches 1``, the quantization included) it was 1.14-1.42x faster
than the fastest float GEMV at every Llama-3.1-8B shape but Q8_0's 1024x4096, and reads Q8_0 at 0.60-1.01 of the
copy kernel's bandwidth, Q4_K at 0.21-0.56, Q6_K at 0.25-0.76.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.gguf_blocks import _load
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.plane_i8_dot import quantize_blocks
from xinfer_cuda.kernels.plane_linear import (
    _format_args,
    _plane_views,
    _scale_bias,
    _store_row_sums,
    gemv_splits,
    plane_layout,
)
from xinfer_cuda.kernels.splits import partial_sums, sum_splits

PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")
TILES = tl.constexpr(16)  # tiles a warp's step: 16 tiles' 2 halves, a thread each
HIGH_BITS = tl.constexpr(-0x7F7F7F80)  # 0x80808080 as an int32: every byte's top bit


@dataclass(frozen=True)
class PlaneI8GemvConfig:
    block_n: int  # rows of W per program: a warp's rows (in each thread's registers) times the warps
    num_warps: int
    split: int = 1  # programs along K a row tile


@triton.jit
def _dp4a(a, b, acc):
    """``acc`` plus the four products of the signed bytes of ``a`` and ``b``."""
    if PTX:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], dtype=tl.int32,
                                         is_pure=True, pack=1)  # fmt: skip
    else:
        for i in tl.static_range(4):
            acc += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return acc


@triton.jit
def _byte(word, j):
    return (word >> (8 * j)) & 0xFF


@triton.jit
def _transpose_bytes(w0, w1, w2, w3):
    """Byte ``j`` of the four words as word ``j`` (``w0``'s byte lowest): the bytes of ``w0, w1`` and of ``w2, w3``
    interleaved, then the 16-bit halves of those pairs."""
    if PTX:
        return tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t0, t1, t2, t3;
            prmt.b32 t0, $4, $5, 0x5140;
            prmt.b32 t1, $4, $5, 0x7362;
            prmt.b32 t2, $6, $7, 0x5140;
            prmt.b32 t3, $6, $7, 0x7362;
            prmt.b32 $0, t0, t2, 0x5410;
            prmt.b32 $1, t0, t2, 0x7632;
            prmt.b32 $2, t1, t3, 0x5410;
            prmt.b32 $3, t1, t3, 0x7632;
            }
            """,
            "=r,=r,=r,=r,r,r,r,r",
            [w0, w1, w2, w3],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        t0 = _byte(w0, 0) | (_byte(w1, 0) << 8) | (_byte(w2, 0) << 16) | (_byte(w3, 0) << 24)
        t1 = _byte(w0, 1) | (_byte(w1, 1) << 8) | (_byte(w2, 1) << 16) | (_byte(w3, 1) << 24)
        t2 = _byte(w0, 2) | (_byte(w1, 2) << 8) | (_byte(w2, 2) << 16) | (_byte(w3, 2) << 24)
        t3 = _byte(w0, 3) | (_byte(w1, 3) << 8) | (_byte(w2, 3) << 16) | (_byte(w3, 3) << 24)
        return t0, t1, t2, t3


@triton.jit
def _less_zero(codes, ZERO: tl.constexpr):
    """Four codes (bytes below 128) less ``ZERO`` each, as signed bytes: with each byte's top bit set the
    subtraction borrows across no byte, and flipping the top bits back makes each ``128 + code - ZERO`` the
    signed byte ``code - ZERO``."""
    return ((codes | HIGH_BITS) - ZERO * 0x01010101) ^ HIGH_BITS


@triton.jit
def _signed(FMT: tl.constexpr, codes):
    """A symmetric type's codes less its code of 0; an affine type's as they are."""
    if FMT == "Q6_K":
        return _less_zero(codes, 32)
    elif FMT == "Q5_0":
        return _less_zero(codes, 16)
    elif FMT == "Q4_0":
        return _less_zero(codes, 8)
    else:
        return codes


@triton.jit
def _halves(a, b, AT: tl.constexpr):
    """The 16-bit halves at bit ``AT`` of two words of Q8_0's codes (plus 128) as one word of 4 signed codes."""
    if AT == 0:
        return ((a & 0xFFFF) | (b << 16)) ^ HIGH_BITS
    else:
        return (((a >> 16) & 0xFFFF) | (b & -65536)) ^ HIGH_BITS


@triton.jit
def _four(v):
    """The 4 entries of ``v``'s last dimension (a thread's 16-byte load) as 4 tensors."""
    even, odd = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2], v.shape[3], v.shape[4], 2, 2)))
    first, third = tl.split(even)
    second, fourth = tl.split(odd)
    return first, second, third, fourth


@triton.jit
def _nibble_sums(FMT: tl.constexpr, J: tl.constexpr, rows_bytes, high, x_even, x_odd):
    """The two ``dp4a`` of byte ``J`` of the four words (gathered in ``rows_bytes``): its low nibbles (the even
    columns) with ``x_even``, its high nibbles with ``x_odd``, each with its high bits (Q5's ``high``: the words'
    high bytes; Q6_K's: the gathered byte ``J // 2`` of their high bits)."""
    low = rows_bytes & 0x0F0F0F0F
    up = (rows_bytes >> 4) & 0x0F0F0F0F
    if FMT == "Q5_0" or FMT == "Q5_1":  # bit f of the word's high byte
        low |= ((high >> (2 * J)) & 0x01010101) << 4
        up |= ((high >> (2 * J + 1)) & 0x01010101) << 4
    elif FMT == "Q6_K":  # bits 2 f, 2 f + 1 of the word's high half; byte J // 2 of it gathered in high
        low |= ((high >> (4 * (J % 2))) & 0x03030303) << 4
        up |= ((high >> (4 * (J % 2) + 2)) & 0x03030303) << 4
    return _dp4a(_signed(FMT, up), x_odd, _dp4a(_signed(FMT, low), x_even, tl.zeros_like(low)))


@triton.jit
def _block_sum(FMT: tl.constexpr, sums):
    """A block's integer sum of a thread's 4 loads [4, ...] (Q6_K: of each sub-block of 16, two loads each)."""
    if FMT == "Q6_K":
        return tl.sum(tl.reshape(sums, (2, 2, sums.shape[1], sums.shape[2], sums.shape[3], sums.shape[4])), axis=1)
    else:
        return tl.sum(sums, axis=0, keep_dims=True)


@triton.jit
def _scaled(FMT: tl.constexpr, F: tl.constexpr, sums, scales, supers, h, d_ptr, s_ptr, x_block, mask, x_mask):
    """The float sum of field ``F``'s block of half ``h`` from its integer sums: times the weight's and the
    activations' scales, plus an affine type's bias times the activations' exact sum."""
    if FMT == "Q6_K":  # sub-blocks 4 (F // 2) + 2 h + c // 2 of 16: a scale each
        g = 2 * h + tl.arange(0, 2)[:, None, None, None, None]
    else:
        g = h
    scale, bias = _scale_bias(FMT, F, scales, supers, g, mask)
    x_scale = _load(d_ptr + x_block, x_mask)
    total = tl.sum(_block_sum(FMT, sums).to(tl.float32) * scale, axis=0, keep_dims=True) * x_scale
    if FMT == "Q4_1" or FMT == "Q5_1" or FMT == "Q4_K":
        total += _load(s_ptr + x_block, x_mask) * bias
    return total


@triton.jit
def _gathered_high(FMT: tl.constexpr, high_ptr, at, mask):
    """The high bits of a thread's 4 words: Q5's high bytes (one word), Q6_K's high halves with byte ``b`` of
    the four gathered into word ``b`` (two ``prmt``: the loads' bytes 0, 2, 4, 6 and 1, 3, 5, 7)."""
    if FMT == "Q6_K":
        pair_mask = None if mask is None else _last(mask)
        first, second = tl.split(_load(high_ptr + 2 * _last(at) + tl.arange(0, 2), pair_mask))
        low = (first & 0xFF) | ((first >> 8) & 0xFF00) | ((second & 0xFF) << 16) | ((second << 8) & -0x1000000)
        up = ((first >> 8) & 0xFF) | ((first >> 16) & 0xFF00) | ((second << 8) & 0xFF0000) | (second & -0x1000000)
        return low, up
    elif FMT == "Q5_0" or FMT == "Q5_1":
        high = _load(high_ptr + at, mask)
        return high, high
    else:  # (no high bits: unused)
        return at, at


@triton.jit
def _last(v):
    """A 5-D ``v`` with a last dimension of 1, to broadcast along a load's words."""
    return v[:, :, :, :, :, None]


@triton.jit
def _step(acc, t0, q_ptr, d_ptr, s_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, N, num_tiles, last,
          FMT: tl.constexpr, FIELDS: tl.constexpr, PER_TILE: tl.constexpr, EVEN: tl.constexpr, R: tl.constexpr,
          W: tl.constexpr, WAIT: tl.constexpr):  # fmt: skip
    """``acc`` [1, R, W, TILES, 2] plus the products of tiles ``t0 ..`` of the rows [R, W]: in a thread, 4 loads
    of each of R rows' codes (dimensions [4 loads c, R rows, W warps, TILES tiles, 2 halves h], a load's 4 words
    a sixth); ``WAIT``: the chain's wait for the kernel that writes the activations between the weight's loads and
    theirs."""
    n = rows[None, :, :, None, None].to(tl.int64)
    c = tl.arange(0, 4)[:, None, None, None, None]
    h = tl.arange(0, 2)[None, None, None, None, :]
    e = tl.arange(0, 4)
    warp = tl.arange(0, W)[None, None, :, None, None] * 0  # the activations loaded a copy a warp
    shape: tl.constexpr = (1, R, W, TILES, 2)
    tile = t0 + tl.arange(0, TILES)[None, None, None, :, None]
    row_tile = n * num_tiles + tile
    mask = None if EVEN else tl.broadcast_to((n < N) & (tile < last), shape)
    x_mask = None if EVEN else tl.broadcast_to(tile < last, (1, 1, W, TILES, 2))
    words_mask = None if EVEN else tl.broadcast_to(mask, (4, R, W, TILES, 2))
    load_mask = None if EVEN else _last(words_mask)
    load = 4 * h + c  # a thread's 16 bytes of each row's codes
    w0, w1, w2, w3 = _four(_load(codes_ptr + _last(row_tile * 32 + 4 * load) + e, load_mask))
    high_low, high_up = _gathered_high(FMT, high_ptr, row_tile * 8 + load, words_mask)
    scales = tl.broadcast_to(scales_ptr + row_tile * PER_TILE, shape)
    supers = tl.broadcast_to(supers_ptr + row_tile, shape)
    pdl_entry(WAIT)
    # the activations' words in quantize_blocks' order: FIELDS a load of codes (8 fields: the even columns' 4,
    # then the odd ones')
    x_at = _last(tile * (8 * FIELDS) + load * FIELDS + warp) + e
    x_load_mask = None if EVEN else _last(tl.broadcast_to(x_mask, (4, 1, W, TILES, 2)))
    xs = _four(_load(q_ptr + x_at, x_load_mask))
    x_block = tile * FIELDS + h + warp  # the activations' block of field 0 of half h; field F's: + 2 (F // 2)
    if FIELDS == 4:  # Q8_0's bytes: words (w0, w1) and (w2, w3), their low halves block h, high ones 2 + h
        low = _dp4a(_halves(w2, w3, 0), xs[2], _dp4a(_halves(w0, w1, 0), xs[0], tl.zeros_like(w0)))
        up = _dp4a(_halves(w2, w3, 16), xs[3], _dp4a(_halves(w0, w1, 16), xs[1], tl.zeros_like(w0)))
        acc += _scaled(FMT, 0, low, scales, supers, h, d_ptr, s_ptr, x_block, mask, x_mask)
        acc += _scaled(FMT, 2, up, scales, supers, h, d_ptr, s_ptr, x_block + 2, mask, x_mask)
    else:
        odd = _four(_load(q_ptr + x_at + 4, x_load_mask))
        gathered = _transpose_bytes(w0, w1, w2, w3)
        for j in tl.static_range(4):
            sums = _nibble_sums(FMT, j, gathered[j], high_low if j < 2 else high_up, xs[j], odd[j])
            acc += _scaled(FMT, 2 * j, sums, scales, supers, h, d_ptr, s_ptr, x_block + 2 * j, mask, x_mask)
    return acc


@triton.jit
def _plane_i8_gemv_kernel(
    q_ptr, d_ptr, s_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, bias_ptr, y_ptr, N, K, tiles_per_split,
    FMT: tl.constexpr, FIELDS: tl.constexpr, HIGH: tl.constexpr, SUB: tl.constexpr, PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr, R: tl.constexpr, W: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # row r W + w of the program's: R rows in a thread's registers, the warps on rows
    rows = tl.program_id(0) * (R * W) + tl.arange(0, R)[:, None] * W + tl.arange(0, W)[None, :]
    num_tiles = K // (32 * FIELDS)
    first = tl.program_id(1) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    # the first step's code words in flight before the wait on the activations' quantization (every program has
    # a step): they overlap it
    acc = _step(tl.zeros((1, R, W, TILES, 2), dtype=tl.float32), first, q_ptr, d_ptr, s_ptr, codes_ptr, high_ptr,
                scales_ptr, supers_ptr, rows, N, num_tiles, last, FMT, FIELDS, PER_TILE, EVEN, R, W, PDL)  # fmt: skip
    for t0 in range(first + TILES, last, TILES):
        acc = _step(acc, t0, q_ptr, d_ptr, s_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, N, num_tiles,
                    last, FMT, FIELDS, PER_TILE, EVEN, R, W, False)  # fmt: skip
    y = tl.reshape(tl.sum(tl.sum(acc, axis=4), axis=3), (R, W))
    _store_row_sums(y, y_ptr, bias_ptr, rows, N, HAS_BIAS, PARTIAL)


def plane_i8_gemv(x: Tensor, raw: Tensor, name: str, n: int, bias: Tensor | None = None,
                  config: PlaneI8GemvConfig | None = None) -> Tensor:  # fmt: skip
    """``x`` [1, K] times the weight [n, K] whose planes are ``raw``, its activations quantized to int8 per block
    of 32: [1, n] in ``x``'s dtype."""
    layout = plane_layout(name, x.shape[1])
    quantized = quantize_blocks(x.contiguous(), order=layout.fields)
    return quantized_gemv(quantized, raw, name, n, x.dtype, bias, config)


def quantized_gemv(quantized: tuple[Tensor, Tensor, Tensor], raw: Tensor, name: str, n: int, dtype: torch.dtype,
                   bias: Tensor | None = None, config: PlaneI8GemvConfig | None = None) -> Tensor:  # fmt: skip
    """:func:`plane_i8_gemv` of activations already quantized (``quantize_blocks(x, order=fields)``, or the norm's
    kernel that made ``x``): [1, n] in ``dtype``."""
    q, d, s = quantized
    k = q.shape[1]
    layout = plane_layout(name, k)
    config = config or PlaneI8GemvConfig(4, 4)
    y = torch.empty(1, n, dtype=dtype, device=q.device)
    if n == 0:
        return y
    num_tiles = k // layout.tile
    per_split, split, even = gemv_splits(n, num_tiles, config.block_n, config.split, TILES.value)
    partial = partial_sums(y, split)
    codes, high, scales, supers = _plane_views(raw, layout, n, k)
    _plane_i8_gemv_kernel[(triton.cdiv(n, config.block_n), split)](
        q.view(torch.int32), d, s, codes, high.view(torch.int32), scales, supers, bias if bias is not None else y,
        partial, n, k, per_split, HAS_BIAS=bias is not None, PARTIAL=split > 1, EVEN=even,
        R=config.block_n // config.num_warps, W=config.num_warps, num_warps=config.num_warps, **_format_args(layout),
        **launch.pdl(q.device),
    )  # fmt: skip
    return sum_splits(partial, bias, y)
