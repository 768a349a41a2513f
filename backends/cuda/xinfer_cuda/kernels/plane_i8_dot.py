"""Linear ``y = x W^T (+ bias)`` over a GGUF weight in planes on the integer tensor cores, for a few
rows of ``x`` (decode batches): what llama.cpp's batched decode does (its MMQ kernels).

The activations are quantized per block of 32 columns (:func:`quantize_blocks`: ``x ~ d_x q_x``, int8
``q_x``, and each block's exact sum ``s_x``); the weight's codes go to the dot as they are stored, as int8
(Q8_0's less the 128 they are stored plus). A block of 32 columns is then one int8 dot of the activations'
codes with the weight rows' codes, and with ``value = scale * code + bias`` per (weight row, block)
(:func:`~xinfer_cuda.kernels.plane_linear._scale_bias`):

    sum over the block of x w = d_x * scale * (q_x . code) + s_x * bias   (up to x's rounding to q_x),

where a symmetric type's codes are taken less the code of 0 (its bias then 0: Q8_0, Q4_0, Q5_0, Q6_K).

In a tile of the planes the block ``2 p + h`` of 32 columns is fields ``2 p`` and ``2 p + 1`` of words
``16 h .. 16 h + 15``, interleaved (column ``2 w + f % 2``): joined, the two fields' codes are the block's
codes in column order. Q6_K's sub-blocks are 16 values, each with its scale: a block is two dots, each with
the activations of the other half zeroed.

Each block's dot is consumed (scaled into the fp32 accumulator) as soon as it is made. In the sm_90 build a
tile of 64 activation rows goes to wgmma with the decoded codes stored to shared memory first (a fence and two
barriers a block); with ``weight_rows_first`` the weight's rows are the MMA's M and its codes its first operand,
which wgmma reads from registers (one barrier fewer a block; the accumulator is then [outputs, rows]). ``halves``
2 makes a loop step a whole tile, so that the scales of both halves are loaded together (the scale loads are not
pipelined as the codes are, and each step waits for them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.gguf_blocks import _load
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.plane_linear import _format_args, _plane_views, _scale_bias, plane_layout
from xinfer_cuda.kernels.splits import k_splits, partial_sums, sum_splits

BLOCK = 32  # columns of an activation block: one scale, one sum


@dataclass(frozen=True)
class PlaneI8DotConfig:
    block_m: int  # rows of x per program (16: the smallest tensor-core tile)
    block_n: int
    num_warps: int
    num_stages: int
    split: int = 1  # programs along K a tile of [block_m, block_n] outputs
    weight_rows_first: bool = False  # the weight's rows as the MMA's M (wgmma with its codes in registers)
    halves: int = 1  # half tiles a loop step (2: a whole tile, the scales of both halves loaded at once)


@triton.jit
def _stored_at(col, ORDER: tl.constexpr):
    """Where the code of column ``col`` is stored: in column order, or (``ORDER`` a planes type's fields a word)
    in the order the one-row int8 GEMV reads a tile's codes (:mod:`~xinfer_cuda.kernels.plane_i8_gemv`): per
    16-byte load ``c`` (4 words) of half ``h`` of a tile, 4 words of 4 codes that share a block (of columns
    ``32 h + 8 c ..``). 8 fields (nibbles): word ``(parity, j)`` holds columns ``64 j + 32 h + 8 c + 2 i + parity``,
    ``i = 0..3``; 4 fields (bytes): word ``k`` columns ``64 (k % 2) + 32 h + 8 c + 4 (k // 2) + i``."""
    if ORDER == 0:
        return col
    else:
        tile, at = col // (32 * ORDER), col % (32 * ORDER)
        load = 4 * ((at // 32) % 2) + (at // 8) % 4  # 4 h + c
        if ORDER == 8:
            word = 4 * (at % 2) + at // 64
            byte = (at // 2) % 4
        else:
            word = 2 * ((at // 4) % 2) + at // 64
            byte = at % 4
        return tile * (32 * ORDER) + 4 * ORDER * load + 4 * word + byte


@triton.jit
def store_blocks(x, q_ptr, d_ptr, s_ptr, m, b, blocks, ORDER: tl.constexpr):
    """Row ``m``'s blocks ``b`` of 32 columns, ``x`` [B, 32] fp32: their int8 codes (in ``ORDER``), scales and
    exact sums stored where :func:`quantize_blocks` puts them."""
    # (divisions rounded to nearest, as torch's: Triton's own fp32 division is approximate on the GPU)
    d = tl.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
    q = tl.div_rn(x, tl.where(d == 0.0, 1.0, d)[:, None])
    q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(0.5 - q))  # to the nearest, halves away from 0
    col = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(q_ptr + m * (32 * blocks) + _stored_at(col, ORDER), q.to(tl.int8), mask=(b < blocks)[:, None])
    tl.store(d_ptr + m * blocks + b, d, mask=b < blocks)
    tl.store(s_ptr + m * blocks + b, tl.sum(x, axis=1), mask=b < blocks)


@triton.jit
def _quantize_blocks_kernel(x_ptr, q_ptr, d_ptr, s_ptr, blocks, stride_x, BLOCKS: tl.constexpr, ORDER: tl.constexpr,
                            PDL: tl.constexpr):  # fmt: skip
    pdl_entry(PDL)
    m = tl.program_id(0)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    col = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m.to(tl.int64) * stride_x + col, mask=(b < blocks)[:, None], other=0.0).to(tl.float32)
    store_blocks(x, q_ptr, d_ptr, s_ptr, m.to(tl.int64), b, blocks, ORDER)


def quantized_blocks(m: int, k: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Where :func:`quantize_blocks` of [m, k] puts its codes, scales and sums."""
    q = torch.empty(m, k, dtype=torch.int8, device=device)
    d = torch.empty(m, k // BLOCK, dtype=torch.float32, device=device)
    return q, d, torch.empty_like(d)


def quantize_blocks(x: Tensor, order: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``x`` [M, K] (K a multiple of 32) as int8 codes [M, K], a scale per block of 32 [M, K / 32] (``x ~ d q``,
    the block's largest magnitude at 127) and each block's sum of ``x`` [M, K / 32], both fp32; the codes in
    column order, or with ``order`` (a planes type's fields a word; K then a multiple of its tile) in the one-row
    int8 GEMV's."""
    m, k = x.shape
    blocks = k // BLOCK
    q, d, s = quantized_blocks(m, k, x.device)
    per_program = 16  # 512 columns: whole tiles of every type
    if m:
        _quantize_blocks_kernel[(m, triton.cdiv(blocks, per_program))](
            x, q, d, s, blocks, x.stride(0), BLOCKS=per_program, ORDER=order, num_warps=4, **launch.pdl(x.device)
        )
    return q, d, s


@triton.jit
def _codes(FMT: tl.constexpr, F: tl.constexpr, word, high):
    """Field ``F``'s codes, int32: a symmetric type's less the code of 0 (Q8_0's 128, Q6_K's 32, Q5_0's 16, Q4_0's
    8), so that its blocks add nothing; an affine type's as stored."""
    if FMT == "Q8_0":
        return ((word >> (8 * F)) & 0xFF) - 128
    elif FMT == "Q6_K":
        return (((word >> (4 * F)) & 0xF) | (((high >> (2 * F)) & 3) << 4)) - 32
    elif FMT == "Q5_0":
        return (((word >> (4 * F)) & 0xF) | (((high >> F) & 1) << 4)) - 16
    elif FMT == "Q5_1":
        return ((word >> (4 * F)) & 0xF) | (((high >> F) & 1) << 4)
    elif FMT == "Q4_0":
        return ((word >> (4 * F)) & 0xF) - 8
    else:
        return (word >> (4 * F)) & 0xF


@triton.jit
def _along_rows(v, WEIGHT_ROWS_FIRST: tl.constexpr):
    """A vector over x's rows broadcast along the accumulator's."""
    return v[None, :] if WEIGHT_ROWS_FIRST else v[:, None]


@triton.jit
def _along_outputs(v, WEIGHT_ROWS_FIRST: tl.constexpr):
    """A vector over the weight's rows (the outputs) broadcast along the accumulator's."""
    return v[:, None] if WEIGHT_ROWS_FIRST else v[None, :]


@triton.jit
def _block_dot(xq, codes, WEIGHT_ROWS_FIRST: tl.constexpr):
    """A block's int32 dot in the accumulator's orientation: the weight's codes as the MMA's first operand (from
    registers, as Hopper's wgmma takes it) or the activations'."""
    if WEIGHT_ROWS_FIRST:
        return tl.dot(codes, tl.trans(xq), out_dtype=tl.int32)
    else:
        return tl.dot(xq, tl.trans(codes), out_dtype=tl.int32)


@triton.jit
def _plane_i8_dot_kernel(
    q_ptr, d_ptr, s_ptr, codes_ptr, high_ptr, scales_ptr, supers_ptr, bias_ptr, y_ptr, M, N, K, stride_y,
    tiles_per_split,
    FMT: tl.constexpr, FIELDS: tl.constexpr, HIGH: tl.constexpr, SUB: tl.constexpr, PER_TILE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HALVES: tl.constexpr, WEIGHT_ROWS_FIRST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = ms < M, rows < N
    n = rows.to(tl.int64)
    num_tiles, blocks = K // (32 * FIELDS), K // 32
    words = tl.arange(0, 16)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M) if WEIGHT_ROWS_FIRST else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    for step in range(2 * first // HALVES, 2 * last // HALVES):
        for j in tl.static_range(HALVES):
            half = step * HALVES + j  # (tile, its half of words)
            t, h = half // 2, half % 2
            at = n[:, None] * (num_tiles * 32) + t * 32 + 16 * h + words
            scales = scales_ptr + n * (num_tiles * PER_TILE) + t * PER_TILE
            supers = supers_ptr + n * num_tiles + t
            word = _load(codes_ptr + at, n_mask[:, None])
            high = _load(high_ptr + at, n_mask[:, None]).to(tl.int32) if HIGH else word
            for p in tl.static_range(FIELDS // 2):
                codes = tl.join(_codes(FMT, 2 * p, word, high), _codes(FMT, 2 * p + 1, word, high))
                codes = tl.reshape(codes, (BLOCK_N, 32)).to(tl.int8)
                block = t * FIELDS + 2 * p + h
                xb = ms.to(tl.int64) * blocks + block
                xq = tl.load(q_ptr + xb[:, None] * 32 + tl.arange(0, 32)[None, :], mask=m_mask[:, None], other=0)
                x_scale = tl.load(d_ptr + xb, mask=m_mask, other=0.0)
                if FMT == "Q6_K":  # sub-blocks 2 h and 2 h + 1 of 16, one dot each (the codes less 32: no bias)
                    first_half = tl.arange(0, 32)[None, :] < 16
                    low_dot = _block_dot(tl.where(first_half, xq, 0).to(tl.int8), codes, WEIGHT_ROWS_FIRST)
                    high_dot = _block_dot(tl.where(first_half, 0, xq).to(tl.int8), codes, WEIGHT_ROWS_FIRST)
                    low_scale, _ = _scale_bias(FMT, 2 * p, scales, supers, 2 * h, n_mask)
                    high_scale, _ = _scale_bias(FMT, 2 * p, scales, supers, 2 * h + 1, n_mask)
                    low_part = low_dot.to(tl.float32) * _along_outputs(low_scale, WEIGHT_ROWS_FIRST)
                    high_part = high_dot.to(tl.float32) * _along_outputs(high_scale, WEIGHT_ROWS_FIRST)
                    acc += _along_rows(x_scale, WEIGHT_ROWS_FIRST) * (low_part + high_part)
                else:
                    dot = _block_dot(xq, codes, WEIGHT_ROWS_FIRST)
                    scale, bias = _scale_bias(FMT, 2 * p, scales, supers, h, n_mask)
                    scales_product = _along_rows(x_scale, WEIGHT_ROWS_FIRST) * _along_outputs(scale, WEIGHT_ROWS_FIRST)
                    acc += dot.to(tl.float32) * scales_product
                    if FMT == "Q4_1" or FMT == "Q5_1" or FMT == "Q4_K":  # affine: the block's sum of x times its bias
                        x_sum = tl.load(s_ptr + xb, mask=m_mask, other=0.0)
                        acc += _along_rows(x_sum, WEIGHT_ROWS_FIRST) * _along_outputs(bias, WEIGHT_ROWS_FIRST)
    if HAS_BIAS and not PARTIAL:
        acc += _along_outputs(tl.load(bias_ptr + rows, mask=n_mask, other=0.0).to(tl.float32), WEIGHT_ROWS_FIRST)
    at_rows = _along_rows(ms.to(tl.int64) * stride_y, WEIGHT_ROWS_FIRST)
    y = y_ptr + tl.program_id(2) * M * N + at_rows + _along_outputs(rows, WEIGHT_ROWS_FIRST)
    mask = _along_rows(m_mask, WEIGHT_ROWS_FIRST) & _along_outputs(n_mask, WEIGHT_ROWS_FIRST)
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)


def plane_i8_dot(x: Tensor, raw: Tensor, name: str, n: int, bias: Tensor | None = None,
                 config: PlaneI8DotConfig | None = None) -> Tensor:  # fmt: skip
    """``x`` [M, K] times the weight [n, K] whose planes are ``raw``, its activations
    quantized to int8 per block of 32: [M, n] in ``x``'s dtype."""
    (m, k) = x.shape
    layout = plane_layout(name, k)
    config = config or PlaneI8DotConfig(16, 64, 4, 3)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    q, d, s = quantize_blocks(x.contiguous())
    per_split, split = k_splits(k // layout.tile, config.split, 1)
    partial = partial_sums(y, split)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    _plane_i8_dot_kernel[grid](
        q, d, s, *_plane_views(raw, layout, n, k), bias if bias is not None else x, partial, m, n, k, n, per_split,
        HAS_BIAS=bias is not None, PARTIAL=split > 1, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        HALVES=config.halves, WEIGHT_ROWS_FIRST=config.weight_rows_first, num_warps=config.num_warps,
        num_stages=config.num_stages, **_format_args(layout), **launch.pdl(x.device),
    )  # fmt: skip
    return sum_splits(partial, bias, y)
