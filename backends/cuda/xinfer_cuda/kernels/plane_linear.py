"""Linear ``y = x W^T (+ bias)`` over a GGUF weight in planes (:mod:`xinfer_cuda.kernels.gguf_planes`).

The GEMV (one row, batch-1 decode) reads a loop step's code words as [block_n rows, tiles, groups,
4 loads, 4 words] tiles with ``tiles = 4 * num_warps``: each thread then holds one 16-byte load of
each row's codes, and Triton gives codes, activations (bf16 or fp16 pairs read as 32-bit words) and
scale words one layout (no shared-memory shuffles). For each field ``f`` of the words:

- ``code * x`` without a conversion instruction: the code's bits, masked where they lie in the word
  (one shift of the word serves its upper fields), or-ed into the mantissa of ``2**e`` (``e`` chosen
  so the code's lowest bit is worth 1) make the float ``2**e + code``, and ``fma(that, x, -2**e x)``
  is ``code * x`` rounded once (``2**e x`` is exact); Q5's and Q6_K's high bits are a second such
  product, with ``16 x``;
- a load's 4 products are summed in the thread and scaled once (the 4 words share a block: a
  field's columns ``64 (f // 2) + 2 w`` are one block of 32 for 16 consecutive words), and what the
  block adds to every value (Q4_K's ``-dmin m``, Q8_0's ``-128 d`` for its codes stored plus 128,
  Q4_1's ``m``) multiplies the sum of those 4 activations, shared by the thread's rows.

In the sm_90 SASS of the loop that is 6.0 instructions a Q4_K value, 5.5 a Q8_0 and 9 a Q6_K one (a
third of them the sub-block scales' decode), against 14 and 10 for the byte-wise kernels of the
file's blocks (:mod:`xinfer_cuda.kernels.quant_linear`), which also load one or two bytes at a time.
Over few rows of the weight the GEMV and the dot may split K over ``split`` programs a tile
(:mod:`xinfer_cuda.kernels.splits`). What keeps
enough of the weight in flight is measured (:class:`PlaneGemvConfig`): the warps on a row's tiles or
on rows, a thread's one load of a tile's 4 words or ``groups``: a group's 16 (its 4 loads and its rows
outermost in the step's 6-D index, so in the thread's registers: one scale decode for 16 values, one
activation decode for the rows), the loop unrolled, and ``early``: the first step's code words loaded before the wait on
the kernel that writes ``x`` (programmatic dependent launch: they overlap its tail).

- :func:`plane_gemv`: one row, :class:`PlaneGemvConfig`;
- :func:`plane_dot`: a few rows (small decode batches): each field's values, decoded the same way,
  one tensor-core dot with the activations' columns of that field, :class:`PlaneDotConfig`;
- :func:`plane_dequantize`: ``W`` in a float dtype (prefill multiplies that densely).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.gguf_blocks import _load
from xinfer_cuda.kernels.gguf_planes import LAYOUTS, PlaneLayout, planes
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.quant_linear import MAX_PACKED_ROWS, Dequantized
from xinfer_cuda.kernels.splits import k_splits, partial_sums, sum_splits

if TYPE_CHECKING:
    from xinfer_cuda.kernels.plane_i8_dot import PlaneI8DotConfig
    from xinfer_cuda.kernels.plane_i8_gemv import PlaneI8GemvConfig

MAGIC = 0x4B000000  # the bits of 2**23: an integer below 2**23 or-ed in is added (passed at run time: one register
# holds it, the masks stay immediates, where two constants would be rematerialized in the loop)


@dataclass(frozen=True)
class PlaneGemvConfig:
    block_n: int  # rows of W per program
    tiles: int  # tiles of each row per loop step (a power of two)
    num_warps: int
    split: int = 1  # programs along K a row tile
    early: bool = False  # the first step's code words loaded before the wait on the kernel that writes x
    # a thread holds a group's SUB words of a tile (4 16-byte loads, Q6_K's 2) and decodes their scale once,
    # rather than one load of them; the warps the tiles leave go to rows, the rows past them to the thread's
    # registers (sharing its activations)
    groups: bool = False
    unroll: int = 1  # loop steps unrolled (their loads issued together)


@dataclass(frozen=True)
class PlaneDotConfig:
    block_m: int  # rows of x per program (16: the smallest tensor-core tile)
    block_n: int
    tiles: int
    num_warps: int
    num_stages: int
    split: int = 1  # programs along K a tile of [block_m, block_n] outputs


def default_plane_gemv(rows: int, k: int, layout: PlaneLayout) -> PlaneGemvConfig:
    """A thread's one 16-byte load of codes a row (``tiles = 4 * num_warps``), 4 rows a program."""
    return PlaneGemvConfig(4, 16, 4)


def default_plane_dot(rows: int) -> PlaneDotConfig:
    return PlaneDotConfig(16, 32, 1, 4, 3) if rows <= 16 else PlaneDotConfig(64, 64, 1, 4, 3)


def _scales_per_tile(fmt: str) -> int:
    """32-bit words of the scale plane a tile."""
    return {"Q8_0": 2, "Q4_0": 4, "Q5_0": 4, "Q4_1": 8, "Q5_1": 8, "Q4_K": 4, "Q6_K": 4}[fmt]


@triton.jit
def _magic_times(bits, S: tl.constexpr, magic, x):
    """``bits`` (an integer below 2**4 at bit ``S``, or 2**8 at 0 or 8) times ``x``, rounded once: or-ed
    into the mantissa of ``2**(23 - S)`` (``magic``: the bits of 2**23) they make the float
    ``2**(23 - S) + code``, and ``fma(that, x, -2**(23 - S) x)`` is ``code * x``."""
    f = (bits | (magic - (S << 23))).to(tl.float32, bitcast=True)
    return tl.fma(f, x, x * (-8388608.0 / (1 << S)))


@triton.jit
def _code_times(FMT: tl.constexpr, F: tl.constexpr, word, high, magic, x):
    """Field ``F``'s codes times ``x``: each part of a code (a byte; a nibble; its high bits, whose
    product is taken with ``16 x``) masked where it lies in its word, one fma each."""
    if FMT == "Q8_0":  # bytes; the upper two moved down by one shift of the word
        return _magic_times((word >> (16 * (F // 2))) & (0xFF << (8 * (F % 2))), 8 * (F % 2), magic, x)
    else:  # nibbles; the upper three moved down by one shift of the word
        low = _magic_times((word >> (12 * (F // 5))) & (0xF << (4 * F - 12 * (F // 5))), 4 * F - 12 * (F // 5),
                           magic, x)  # fmt: skip
        if FMT == "Q6_K":  # 2 high bits a field, at bit 2 F
            return low + _magic_times(high & (3 << (2 * F)), 2 * F, magic, 16.0 * x)
        elif FMT == "Q5_0" or FMT == "Q5_1":  # 1 high bit a field, at bit F
            return low + _magic_times(high & (1 << F), F, magic, 16.0 * x)
        else:
            return low


@triton.jit
def _code(FMT: tl.constexpr, F: tl.constexpr, word, high, magic):
    """Field ``F``'s codes as fp32 (exact)."""
    return _code_times(FMT, F, word, high, magic, 1.0)


@triton.jit
def _f16_at(ptr, mask):
    return _load(ptr, mask).to(tl.float32)


@triton.jit
def _half_of(word, at):
    """The f16 at bit ``at`` (0 or 16) of 32-bit words, as fp32."""
    return (word >> at).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale_bias(FMT: tl.constexpr, F: tl.constexpr, scales, supers, g, mask):
    """Field ``F``'s scale and what its block adds, ``value = scale * code + bias``, each [BLOCK_N, TILES, G, 1, 1]: ``scales`` points
    at the row tiles' scale words [BLOCK_N, TILES, 1, 1, 1] (read as 32-bit words, as the codes are, so
    that they share the codes' layout), ``supers`` at Q6_K's ``d``; ``g`` [1, 1, G, 1, 1] the group of
    the words (the field's columns ``64 (F // 2) + 32 g ..`` are block ``2 (F // 2) + g`` of 32, or
    Q6_K's sub-block ``4 (F // 2) + g`` of 16)."""
    if FMT == "Q8_0" or FMT == "Q4_0" or FMT == "Q5_0":  # d per block of 32: blocks 2p, 2p + 1 in word p
        d = _half_of(_load(scales + F // 2, mask), 16 * g)
        if FMT == "Q8_0":  # codes stored plus 128
            return d, -128.0 * d
        elif FMT == "Q4_0":
            return d, -8.0 * d
        else:
            return d, -16.0 * d
    elif FMT == "Q4_1" or FMT == "Q5_1":  # (d, m) per block, a word each
        dm = _load(scales + 2 * (F // 2) + g, mask)
        return _half_of(dm, 0), _half_of(dm, 16)
    elif FMT == "Q4_K":
        # words: d | dmin << 16; then the 12 bytes of 6-bit scales and mins: sub-blocks 0-3 in the
        # low 6 bits of bytes 0-3 (scales) and 4-7 (mins), 4-7 in the nibbles of bytes 8-11 and the
        # top two bits of bytes 0-7
        head = _load(scales, mask)
        sc_word = _load(scales + 1, mask)
        mn_word = _load(scales + 2, mask)
        block = 2 * (F // 2) + g
        if F < 4:  # sub-blocks 0-3
            sc = (sc_word >> (8 * block)) & 63
            mn = (mn_word >> (8 * block)) & 63
        else:
            both = _load(scales + 3, mask)
            at = 8 * (block - 4)
            sc = ((both >> at) & 15) | (((sc_word >> (at + 6)) & 3) << 4)
            mn = ((both >> (at + 4)) & 15) | (((mn_word >> (at + 6)) & 3) << 4)
        return _half_of(head, 0) * sc.to(tl.float32), -_half_of(head, 16) * mn.to(tl.float32)
    else:
        tl.static_assert(FMT == "Q6_K", "no planes for this GGUF type")
        # int8 scale per sub-block of 16 (4 a word), d per tile; codes plus 32
        s = ((_load(scales + F // 2, mask) << (24 - 8 * g)) >> 24).to(tl.float32) * _f16_at(supers, mask)
        return s, -32.0 * s


@triton.jit
def _tile_words(codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, tile, num_tiles, mask,
                HIGH: tl.constexpr, SUB: tl.constexpr, PER_TILE: tl.constexpr):  # fmt: skip
    """One loop step's code words and high bits [BLOCK_N, TILES, G, SUB / 4, 4] (word ``SUB g + 4 c + e``:
    a thread's 16-byte load is the last dimension), the tiles' scale pointers [BLOCK_N, TILES, 1, 1, 1],
    ``g`` [1, 1, G, 1, 1] and the word index."""
    g = tl.arange(0, 32 // SUB)[None, None, :, None, None]
    w = g * SUB + 4 * tl.arange(0, SUB // 4)[None, None, None, :, None] + tl.arange(0, 4)[None, None, None, None, :]
    n = rows[:, None, None, None, None].to(tl.int64)
    word, high, scales, supers = _words_at(codes_ptr, high_ptr, scales_ptr, supers_ptr, n, tile, w, num_tiles, mask,
                                           HIGH, PER_TILE)  # fmt: skip
    return word, high, scales, supers, g, w


@triton.jit
def _words_at(codes_ptr, high_ptr, scales_ptr, supers_ptr, n, tile, w, num_tiles, mask, HIGH: tl.constexpr,
              PER_TILE: tl.constexpr):  # fmt: skip
    """The code words and high bits of rows ``n``, tiles ``tile``, words ``w`` (broadcast together), and
    the tiles' scale pointers (and Q6_K's ``d``)."""
    word = _load(codes_ptr + n * (num_tiles * 32) + tile * 32 + w, mask)
    if HIGH:
        high = _load(high_ptr + n * (num_tiles * 32) + tile * 32 + w, mask).to(tl.int32)
    else:
        high = word
    return word, high, scales_ptr + n * (num_tiles * PER_TILE) + tile * PER_TILE, supers_ptr + n * num_tiles + tile


@triton.jit
def _activation_pair(x_ptr, pair_at, mask, XS: tl.constexpr):
    """The activations of the two fields of a pair, fp32, at the column pairs ``pair_at`` (columns
    ``2 pair_at`` of the even field, ``2 pair_at + 1`` of the odd one): the halves of one 32-bit word
    of a 16-bit pair (``XS`` "bf16" or "fp16": ``x_ptr`` the activations as int32 words), or two fp32
    loads."""
    if XS == "fp32":
        if mask is None:
            return tl.load(x_ptr + 2 * pair_at), tl.load(x_ptr + 2 * pair_at + 1)
        else:
            even = tl.load(x_ptr + 2 * pair_at, mask=mask, other=0.0)
            return even, tl.load(x_ptr + 2 * pair_at + 1, mask=mask, other=0.0)
    else:
        pair = _load(x_ptr + pair_at, mask)
        if XS == "bf16":  # a bf16 is the top half of its fp32
            return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)
        else:
            low = pair.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            return low, (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _step_index(rows, t0, TILES: tl.constexpr, SUB: tl.constexpr, GROUPS: tl.constexpr):
    """A GEMV step's rows, tiles, groups and words, broadcast together: [BLOCK_N, TILES, G, SUB / 4, 4]
    (a thread's 16-byte load the last dimension, Triton's threads on the loads, groups and tiles) or,
    with ``GROUPS``, [SUB / 4, R, W, TILES, G, 4] for ``rows`` [R, W] (a group's loads and R rows in a
    thread's registers, W warps on the rows, the threads on the groups and tiles)."""
    if GROUPS:
        n = rows[None, :, :, None, None, None]
        tile = t0 + tl.arange(0, TILES)[None, None, None, :, None, None]
        g = tl.arange(0, 32 // SUB)[None, None, None, None, :, None]
        c = tl.arange(0, SUB // 4)[:, None, None, None, None, None]
        e = tl.arange(0, 4)[None, None, None, None, None, :]
    else:
        n = rows[:, None, None, None, None]
        tile = t0 + tl.arange(0, TILES)[None, :, None, None, None]
        g = tl.arange(0, 32 // SUB)[None, None, :, None, None]
        c = tl.arange(0, SUB // 4)[None, None, None, :, None]
        e = tl.arange(0, 4)[None, None, None, None, :]
    return n, tile, g, g * SUB + 4 * c + e


@triton.jit
def _load_sum(v, GROUPS: tl.constexpr):
    """The sum of ``v`` over a group's words in a thread: its 16-byte load (with ``GROUPS``, its loads)."""
    if GROUPS:
        return tl.sum(tl.sum(v, axis=5, keep_dims=True), axis=0, keep_dims=True)
    else:
        return tl.sum(v, axis=4, keep_dims=True)


@triton.jit
def _gemv_step(acc, t0, x_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, N, num_tiles, last, magic,
               FMT: tl.constexpr, FIELDS: tl.constexpr, HIGH: tl.constexpr, SUB: tl.constexpr,
               PER_TILE: tl.constexpr, XS: tl.constexpr, EVEN: tl.constexpr, TILES: tl.constexpr,
               BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ROW_WARPS: tl.constexpr, X_EACH_ROW: tl.constexpr,
               WAIT: tl.constexpr):  # fmt: skip
    """``acc`` plus the products of the tiles ``t0 ..`` of the rows; ``WAIT``: the chain's wait for the
    kernel that writes ``x`` between the code words' loads and the activations' (no kernel writes the
    weights)."""
    n, tile, g, w = _step_index(rows, t0, TILES, SUB, GROUPS)
    has_tile = tile < last
    mask = None if EVEN else (n < N) & has_tile
    word, high, scales, supers = _words_at(codes_ptr, high_ptr, scales_ptr, supers_ptr, n.to(tl.int64), tile, w,
                                           num_tiles, mask, HIGH, PER_TILE)  # fmt: skip
    if GROUPS:  # a scale per (row, tile, group) as the codes' layout has them, not one a thread
        scales = tl.broadcast_to(scales, (1, BLOCK_N // ROW_WARPS, ROW_WARPS, TILES, 32 // SUB, 1))
        supers = tl.broadcast_to(supers, (1, BLOCK_N // ROW_WARPS, ROW_WARPS, TILES, 32 // SUB, 1))
    pdl_entry(WAIT)
    # per (row, tile, group, 16-byte load or group): the products of its words summed in the thread, then
    # scaled once, and the block's bias times the sum of their activations. The activations are loaded
    # in the codes' layout, a copy a warp (or a row): given fewer than 4 a thread, Triton spreads them
    # over the threads, then shuffles every product through shared memory.
    for p in tl.static_range(FIELDS // 2):
        pair_at = tile * (16 * FIELDS) + 32 * p + w
        if GROUPS:
            pair_at = tl.broadcast_to(pair_at, (SUB // 4, 1, ROW_WARPS, TILES, 32 // SUB, 4))
        elif X_EACH_ROW:
            pair_at = tl.broadcast_to(pair_at, word.shape)
        xs = _activation_pair(x_ptr, pair_at, None if EVEN else has_tile, XS)
        for q in tl.static_range(2):
            x = xs[q]
            scale, bias = _scale_bias(FMT, 2 * p + q, scales, supers, g, mask)
            product = _code_times(FMT, 2 * p + q, word, high, magic, x)
            acc = tl.fma(_load_sum(product, GROUPS), scale, acc)
            acc = tl.fma(_load_sum(x, GROUPS), bias, acc)
    return acc


@triton.jit
def _store_row_sums(y, y_ptr, bias_ptr, rows, N, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr):
    """A GEMV's sums ``y`` of its ``rows``: this split's partial sums (fp32), or the outputs (plus the bias)."""
    if PARTIAL:
        tl.store(y_ptr + tl.program_id(1) * N + rows, y, mask=rows < N)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _plane_gemv_kernel(
    x_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, bias_ptr, y_ptr, N, K, tiles_per_split, magic,
    FMT: tl.constexpr, FIELDS: tl.constexpr, HIGH: tl.constexpr, SUB: tl.constexpr, PER_TILE: tl.constexpr,
    XS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES: tl.constexpr, GROUPS: tl.constexpr, ROW_WARPS: tl.constexpr, X_EACH_ROW: tl.constexpr,
    EARLY: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if GROUPS:  # [R, W]: row r W + w of the program's
        R: tl.constexpr = BLOCK_N // ROW_WARPS
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, R)[:, None] * ROW_WARPS + tl.arange(0, ROW_WARPS)[None, :]
        acc = tl.zeros((1, R, ROW_WARPS, TILES, 32 // SUB, 1), dtype=tl.float32)
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, TILES, 32 // SUB, SUB // 4, 1), dtype=tl.float32)
    num_tiles = K // (32 * FIELDS)
    first = tl.program_id(1) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    if EARLY:  # the first step's code words in flight before the wait (every program has a step)
        acc = _gemv_step(acc, first, x_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, N, num_tiles, last,
                         magic, FMT, FIELDS, HIGH, SUB, PER_TILE, XS, EVEN, TILES, BLOCK_N, GROUPS, ROW_WARPS,
                         X_EACH_ROW, PDL)  # fmt: skip
        first += TILES
    else:
        pdl_entry(PDL)
    for t0 in tl.range(first, last, TILES, loop_unroll_factor=UNROLL):
        acc = _gemv_step(acc, t0, x_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, N, num_tiles, last, magic,
                         FMT, FIELDS, HIGH, SUB, PER_TILE, XS, EVEN, TILES, BLOCK_N, GROUPS, ROW_WARPS,
                         X_EACH_ROW, False)  # fmt: skip
    if GROUPS:
        y = tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=5), axis=4), axis=3), axis=0)  # [R, W]
    else:
        y = tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=2), axis=1)
    _store_row_sums(y, y_ptr, bias_ptr, rows, N, HAS_BIAS, PARTIAL)


@triton.jit
def _field_values(FMT: tl.constexpr, F: tl.constexpr, word, high, scales, supers, g, mask, magic):
    scale, bias = _scale_bias(FMT, F, scales, supers, g, mask)
    return _code(FMT, F, word, high, magic) * scale + bias


@triton.jit
def _plane_dot_kernel(
    x_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_y, tiles_per_split,
    magic,
    FMT: tl.constexpr, FIELDS: tl.constexpr, HIGH: tl.constexpr, SUB: tl.constexpr, PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + ms[:, None].to(tl.int64) * stride_x
    num_tiles = K // (32 * FIELDS)
    t = tl.arange(0, TILES)[None, :, None, None, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * tiles_per_split
    for t0 in range(first, tl.minimum(first + tiles_per_split, num_tiles), TILES):
        tile = t0 + t
        has_tile = tile < num_tiles
        mask = (rows[:, None, None, None, None] < N) & has_tile
        word, high, scales, supers, g, _ = _tile_words(codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, tile,
                                                       num_tiles, mask, HIGH, SUB, PER_TILE)  # fmt: skip
        # a pair's 64 columns of each tile, as [BLOCK_M, TILES * 32, 2]: the even field's and the odd one's
        pair_tiles = t0 + tl.arange(0, TILES)[:, None]
        cols = tl.reshape(pair_tiles * (32 * FIELDS) + tl.arange(0, 64)[None, :], (TILES * 64,))
        x_mask = (ms[:, None] < M) & tl.reshape((pair_tiles < num_tiles) & (tl.arange(0, 64)[None, :] >= 0),
                                                (TILES * 64,))[None, :]  # fmt: skip
        for p in tl.static_range(FIELDS // 2):
            x = tl.load(x_rows + cols[None, :] + 64 * p, mask=x_mask, other=0.0)
            xs = tl.split(tl.reshape(x, (BLOCK_M, TILES * 32, 2)))
            for q in tl.static_range(2):
                values = _field_values(FMT, 2 * p + q, word, high, scales, supers, g, mask, magic)
                values = tl.reshape(values, (BLOCK_N, TILES * 32))
                acc = tl.dot(xs[q], tl.trans(values.to(x.dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS and not PARTIAL:
        acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + tl.program_id(2) * M * N + ms[:, None].to(tl.int64) * stride_y + rows[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(ms[:, None] < M) & (rows[None, :] < N))


@triton.jit
def _plane_dequant_kernel(
    codes_ptr, high_ptr, scales_ptr, supers_ptr, out_ptr, N, K, magic,
    FMT: tl.constexpr, FIELDS: tl.constexpr, HIGH: tl.constexpr, SUB: tl.constexpr, PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    num_tiles = K // (32 * FIELDS)
    tile = tl.program_id(1) * TILES + tl.arange(0, TILES)[None, :, None, None, None]
    mask = (rows[:, None, None, None, None] < N) & (tile < num_tiles)
    word, high, scales, supers, g, _ = _tile_words(codes_ptr, high_ptr, scales_ptr, supers_ptr, rows, tile,
                                                   num_tiles, mask, HIGH, SUB, PER_TILE)  # fmt: skip
    # fields 2 p and 2 p + 1 are columns 2 w and 2 w + 1 of the tile's 64 for pair p: joined, a thread's load of 4
    # words is 8 consecutive values, one 16-byte store in 16 bits (each field alone: every other column, 2 bytes)
    first_word = g * SUB + 4 * tl.arange(0, SUB // 4)[None, None, None, :, None]
    cols = tile * (32 * FIELDS) + 2 * first_word + tl.arange(0, 8)[None, None, None, None, :]
    out = out_ptr + rows[:, None, None, None, None].to(tl.int64) * K + cols
    for p in tl.static_range(FIELDS // 2):
        even = _field_values(FMT, 2 * p, word, high, scales, supers, g, mask, magic)
        odd = _field_values(FMT, 2 * p + 1, word, high, scales, supers, g, mask, magic)
        pair = tl.reshape(tl.join(even, odd), (BLOCK_N, TILES, 32 // SUB, SUB // 4, 8))
        tl.store(out + 64 * p, pair.to(out_ptr.dtype.element_ty), mask=mask)


X_WORDS = {torch.bfloat16: "bf16", torch.float16: "fp16"}  # activations the GEMV reads as 32-bit pairs


def _plane_views(raw: Tensor, layout: PlaneLayout, n: int, k: int) -> list[Tensor]:
    """The kernels' arguments of a weight's planes: codes (int32 words), high bits (or the codes),
    scales (as :func:`_scale_bias` reads them) and Q6_K's ``d`` (or the scales)."""
    views = planes(raw, layout, n, k)
    codes = views.pop(0).view(torch.int32)
    high = views.pop(0).view(torch.uint16 if layout.high_bits == 2 else torch.uint8) if layout.high_bits else codes
    scales = views[0].view(torch.int32)
    supers = views[1].view(torch.float16) if len(views) > 1 else scales
    return [codes, high, scales, supers]


def _format_args(layout: PlaneLayout) -> dict:
    return dict(FMT=layout.name, FIELDS=layout.fields, HIGH=layout.high_bits > 0,
                SUB=8 if layout.name == "Q6_K" else 16, PER_TILE=_scales_per_tile(layout.name))  # fmt: skip


def plane_layout(name: str, k: int) -> PlaneLayout:
    layout = LAYOUTS.get(name)
    if layout is None or not layout.fits(k):
        raise ValueError(f"no planes for GGUF type {name!r} in rows of {k} values")
    return layout


def _row_warps(config: PlaneGemvConfig, layout: PlaneLayout) -> int:
    """The warps a ``groups`` tile puts on rows: those its tiles' groups (a thread each) leave."""
    on_tiles = max(1, config.tiles * (32 // _format_args(layout)["SUB"]) // 32)
    return min(config.block_n, max(1, config.num_warps // on_tiles)) if config.groups else 1


def gemv_splits(n: int, num_tiles: int, block_n: int, split: int, per_step: int) -> tuple[int, int, bool]:
    """A GEMV's tiles a program along K (whole steps of ``per_step``), the programs a tile of ``block_n`` rows
    takes (at most ``split``), and whether no tile of rows or of K is cut (the kernel's ``EVEN``)."""
    per_split, split = k_splits(num_tiles, split, per_step)
    return per_split, split, n % block_n == 0 and num_tiles % per_split == 0


def plane_gemv(x: Tensor, raw: Tensor, name: str, n: int, bias: Tensor | None = None,
               config: PlaneGemvConfig | None = None) -> Tensor:  # fmt: skip
    """``x`` [1, K] times the weight [n, K] whose planes are ``raw``: [1, n] in ``x``'s dtype."""
    k = x.shape[1]
    layout = plane_layout(name, k)
    config = config or default_plane_gemv(1, k, layout)
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    num_tiles = k // layout.tile
    per_split, split, even = gemv_splits(n, num_tiles, config.block_n, config.split, config.tiles)
    partial = partial_sums(y, split)
    chain = launch.pdl(x.device)
    words = x.view(torch.int32) if x.dtype in X_WORDS else x
    _plane_gemv_kernel[(triton.cdiv(n, config.block_n), split)](
        words, *_plane_views(raw, layout, n, k), bias if bias is not None else x, partial, n, k, per_split, MAGIC,
        XS=X_WORDS.get(x.dtype, "fp32"), HAS_BIAS=bias is not None, PARTIAL=split > 1, EVEN=even, BLOCK_N=config.block_n, TILES=config.tiles,
        GROUPS=config.groups, ROW_WARPS=_row_warps(config, layout), X_EACH_ROW=config.tiles < 4 * config.num_warps, EARLY=config.early, UNROLL=config.unroll, num_warps=config.num_warps, **_format_args(layout), **chain,
    )  # fmt: skip
    return sum_splits(partial, bias, y)


def plane_dot(x: Tensor, raw: Tensor, name: str, n: int, bias: Tensor | None = None,
              config: PlaneDotConfig | None = None) -> Tensor:  # fmt: skip
    """``x`` [M, K] times the weight [n, K] whose planes are ``raw``: [M, n] in ``x``'s dtype."""
    (m, k) = x.shape
    layout = plane_layout(name, k)
    config = config or default_plane_dot(m)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    num_tiles = k // layout.tile
    per_split, split = k_splits(num_tiles, config.split, config.tiles)
    partial = partial_sums(y, split)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    _plane_dot_kernel[grid](
        x, *_plane_views(raw, layout, n, k), bias if bias is not None else x, partial, m, n, k, x.stride(0), n,
        per_split, MAGIC, HAS_BIAS=bias is not None, PARTIAL=split > 1, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, TILES=config.tiles, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **_format_args(layout), **launch.pdl(x.device),
    )  # fmt: skip
    return sum_splits(partial, bias, y)


def plane_dequantize(raw: Tensor, name: str, n: int, k: int, dtype: torch.dtype, block_n: int = 4,
                     tiles: int | None = None, num_warps: int = 4) -> Tensor:  # fmt: skip
    """The weight [n, k] whose planes are ``raw``, in ``dtype``: a program decodes ``block_n`` rows of ``tiles``
    tiles (256 values a row by default; the fastest of ``quant_decode.py --dequant`` on an H100: 4 rows of 256
    values read and write Q8_0 at 84 % of the copy bandwidth, 16 rows at 25 %)."""
    layout = plane_layout(name, k)
    out = torch.empty(n, k, dtype=dtype, device=raw.device)
    tiles = tiles or max(1, 256 // layout.tile)
    if n:
        grid = (triton.cdiv(n, block_n), triton.cdiv(k // layout.tile, tiles))
        _plane_dequant_kernel[grid](*_plane_views(raw, layout, n, k), out, n, k, MAGIC, BLOCK_N=block_n, TILES=tiles,
                                    num_warps=num_warps, **_format_args(layout), **launch.pdl(raw.device))  # fmt: skip
    return out


def plane_rows(
    x: Tensor,
    raw: Tensor,
    name: str,
    bias: Tensor | None = None,
    config: PlaneGemvConfig | PlaneDotConfig | PlaneI8GemvConfig | PlaneI8DotConfig | Dequantized | None = None,
) -> Tensor:
    """``x`` [M, K] times the weight whose planes are ``raw`` in ``config``'s kernel and tile (the int8 kernels':
    :mod:`~xinfer_cuda.kernels.plane_i8_gemv`, :mod:`~xinfer_cuda.kernels.plane_i8_dot`); without one, the GEMV for one row, the dot kernel up to
    ``MAX_PACKED_ROWS`` rows, past them the weight dequantized for the call (prefill)."""
    from xinfer_cuda.kernels.plane_i8_dot import PlaneI8DotConfig, plane_i8_dot  # (they import this module)
    from xinfer_cuda.kernels.plane_i8_gemv import PlaneI8GemvConfig, plane_i8_gemv

    k = x.shape[1]
    layout = plane_layout(name, k)
    n = raw.numel() // (k // layout.tile * sum(layout.tile_bytes()))
    if isinstance(config, PlaneI8DotConfig):
        return plane_i8_dot(x, raw, name, n, bias, config)
    if isinstance(config, PlaneI8GemvConfig):
        return plane_i8_gemv(x, raw, name, n, bias, config)
    if isinstance(config, Dequantized) or (config is None and x.shape[0] > MAX_PACKED_ROWS):
        return F.linear(x, plane_dequantize(raw, name, n, k, x.dtype), bias)
    if isinstance(config, PlaneGemvConfig) or (config is None and x.shape[0] == 1):
        assert x.shape[0] == 1, x.shape
        return plane_gemv(x, raw, name, n, bias, config)
    return plane_dot(x, raw, name, n, bias, config)
