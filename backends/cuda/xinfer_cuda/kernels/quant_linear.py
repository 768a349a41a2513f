"""Linear ``y = x W^T (+ bias)`` over a GGUF-packed ``W`` [N, K] (uint8 [N, K / qk * nbytes],
:mod:`xinfer_cuda.kernels.gguf_blocks`), dequantized in registers, never in memory.

- One row (decode at batch 1, :class:`QGemvConfig`): a stream over the packed bytes; a
  program owns ``block_n`` rows of ``W`` and walks their blocks ``blocks`` at a time,
  multiplying each decoded part with the activations gathered in the block's order into
  a [block_n, groups, span] fp32 accumulator on the FMA units, summed once at the end.
- Several rows (small decode batches and prefill, :class:`QDotConfig`): a program owns a
  [block_m, block_n] tile of ``y``; each decoded part, cast to the activations' dtype, is
  one tensor-core dot with the activations' columns of that part. With ``block_m = 16``
  this is the small-batch kernel (every weight byte read once for up to 16 rows), with
  larger ``block_m`` the prefill GEMM (the weights read ``M / block_m`` times, the decode
  shared by ``block_m`` rows). Over few tiles of ``y`` a row's blocks may be split over
  programs (:mod:`xinfer_cuda.kernels.splits`).
- :func:`dequantize` writes ``W`` in a float dtype (the fallback's dequantize-then-matmul,
  and what the benchmarks weigh the kernels against).

The accumulation is fp32 whatever the activations' dtype (bf16, fp16 or fp32).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.gguf_blocks import FORMATS, BlockFormat, decode_part
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.splits import k_splits, partial_sums, sum_splits


@dataclass(frozen=True)
class QGemvConfig:
    block_n: int  # rows of W per program
    blocks: int  # GGUF blocks of each row per loop step (a power of two)
    num_warps: int


@dataclass(frozen=True)
class QDotConfig:
    block_m: int  # rows of x per program (16: the smallest tensor-core tile)
    block_n: int
    blocks: int
    num_warps: int
    num_stages: int
    split: int = 1  # programs along K a tile of [block_m, block_n] outputs (:mod:`xinfer_cuda.kernels.splits`)


def default_gemv(fmt: BlockFormat) -> QGemvConfig:
    return QGemvConfig(block_n=4, blocks=max(1, 256 // fmt.qk), num_warps=4)


def default_dot(fmt: BlockFormat, rows: int) -> QDotConfig:
    """Tiles that a tensor-core dot takes in every format: each part is at least 16 columns."""
    blocks = max(1, 64 // fmt.qk)
    if rows <= 16:
        return QDotConfig(16, 32, blocks, 4, 3)
    if rows <= 64:
        return QDotConfig(64, 64, blocks, 4, 3)
    return QDotConfig(128, 64, blocks, 8, 3)


@triton.jit
def _tile_coords(b0, NUM_BLOCKS, BLOCKS: tl.constexpr, GROUPS: tl.constexpr, QK: tl.constexpr,
                 PART_VALUES: tl.constexpr):  # fmt: skip
    """For the loop step over blocks ``b0..b0+BLOCKS``: the block of each group [1, U, 1],
    the group within its block, whether the block exists, and the K column of the group's
    first value."""
    u = tl.arange(0, BLOCKS * GROUPS)[None, :, None]
    blk = b0 + u // GROUPS
    g = u % GROUPS
    return blk, g, blk < NUM_BLOCKS, blk * QK + g * PART_VALUES


@triton.jit
def row_dots(
    x_ptr,
    w_rows,
    rows,
    N,
    K,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    NBYTES: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTS: tl.constexpr,
    SPAN: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
):
    """The dot products of the row ``x`` [K] with packed rows ``rows`` [BLOCK_N] of a weight
    (``w_rows``: their first bytes, [BLOCK_N, 1, 1]), fp32 [BLOCK_N]; ``EVEN``: no row past
    ``N`` and a whole number of loop steps of ``BLOCKS`` blocks."""
    j = tl.arange(0, SPAN)[None, None, :]
    num_blocks = K // QK
    acc = tl.zeros((BLOCK_N, BLOCKS * GROUPS, SPAN), dtype=tl.float32)
    for b0 in range(0, num_blocks, BLOCKS):
        blk, g, has_blk, k0 = _tile_coords(b0, num_blocks, BLOCKS, GROUPS, QK, PARTS * SPAN)
        block = w_rows + blk * NBYTES
        mask = None if EVEN else (rows[:, None, None] < N) & has_blk
        for p in tl.static_range(PARTS):
            w = decode_part(FMT, block, g, p, j, mask)
            if EVEN:
                x = tl.load(x_ptr + k0 + p * SPAN + j)
            else:
                x = tl.load(x_ptr + k0 + p * SPAN + j, mask=has_blk, other=0.0)
            acc += w * x.to(tl.float32)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _qgemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    NBYTES: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTS: tl.constexpr,
    SPAN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + rows[:, None, None].to(tl.int64) * stride_w
    y = row_dots(x_ptr, w_rows, rows, N, K, FMT, QK, NBYTES, GROUPS, PARTS, SPAN, EVEN, BLOCK_N, BLOCKS)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _qdot_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    blocks_per_split,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    NBYTES: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTS: tl.constexpr,
    SPAN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    U: tl.constexpr = BLOCKS * GROUPS
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + ns[:, None, None].to(tl.int64) * stride_w
    x_rows = x_ptr + ms[:, None].to(tl.int64) * stride_x
    j = tl.arange(0, SPAN)[None, None, :]
    num_blocks = K // QK
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    for b0 in range(first, tl.minimum(first + blocks_per_split, num_blocks), BLOCKS):
        blk, g, has_blk, k0 = _tile_coords(b0, num_blocks, BLOCKS, GROUPS, QK, PARTS * SPAN)
        block = w_rows + blk * NBYTES
        mask = (ns[:, None, None] < N) & has_blk
        cols = tl.reshape(k0 + j, (U * SPAN,))  # the K column of each value of part 0
        x_mask = (ms[:, None] < M) & tl.reshape(has_blk & (j >= 0), (U * SPAN,))[None, :]
        for p in tl.static_range(PARTS):
            w = tl.reshape(decode_part(FMT, block, g, p, j, mask), (BLOCK_N, U * SPAN))
            x = tl.load(x_rows + cols[None, :] + p * SPAN, mask=x_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if HAS_BIAS and not PARTIAL:
        acc += tl.load(bias_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + tl.program_id(2) * M * N + ms[:, None].to(tl.int64) * stride_y + ns[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(ms[:, None] < M) & (ns[None, :] < N))


@triton.jit
def _dequant_kernel(
    w_ptr,
    out_ptr,
    N,
    K,
    stride_w,
    stride_out,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    NBYTES: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTS: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    num_blocks = K // QK
    blk, g, has_blk, k0 = _tile_coords(tl.program_id(1) * BLOCKS, num_blocks, BLOCKS, GROUPS, QK, PARTS * SPAN)
    block = w_ptr + rows[:, None, None].to(tl.int64) * stride_w + blk * NBYTES
    mask = (rows[:, None, None] < N) & has_blk
    j = tl.arange(0, SPAN)[None, None, :]
    out = out_ptr + rows[:, None, None].to(tl.int64) * stride_out + k0 + j
    for p in tl.static_range(PARTS):
        w = decode_part(FMT, block, g, p, j, mask)
        tl.store(out + p * SPAN, w.to(out_ptr.dtype.element_ty), mask=mask)


def block_format(name: str) -> BlockFormat:
    fmt = FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"no kernel for GGUF type {name!r}; these have one: {', '.join(FORMATS)}")
    return fmt


def format_args(fmt: BlockFormat, device: torch.device | None = None) -> dict:
    """The kernels' constants of ``fmt``. On a GPU that converts e4m3 itself (SM89 and up), FP8
    blocks decode through that conversion (``FP8_CVT``) instead of integer operations."""
    name = "FP8_CVT" if fmt.name == "FP8" and device is not None and converts_e4m3(device) else fmt.name
    return dict(FMT=name, QK=fmt.qk, NBYTES=fmt.nbytes, GROUPS=fmt.groups, PARTS=fmt.parts, SPAN=fmt.span)


def converts_e4m3(device: torch.device) -> bool:
    return device.type == "cuda" and _capability(
        torch.cuda.current_device() if device.index is None else device.index
    ) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def check_packed(packed: Tensor, fmt: BlockFormat, k: int) -> None:
    assert packed.dtype == torch.uint8 and packed.dim() == 2 and packed.stride(1) == 1, (packed.dtype, packed.shape)
    assert packed.shape[1] == fmt.row_bytes(k), (fmt.name, k, packed.shape)


def quant_linear(
    x: Tensor,
    packed: Tensor,
    fmt_name: str,
    bias: Tensor | None = None,
    config: QGemvConfig | QDotConfig | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``x @ W.T + bias`` for ``x`` [M, K] and ``W`` [N, K] packed in the GGUF type
    ``fmt_name`` as ``packed`` [N, K / qk * nbytes], as [M, N] in ``x``'s dtype. Without a
    ``config``, one row takes the GEMV and more the dot kernel, in default tiles."""
    fmt = block_format(fmt_name)
    (m, k), n = x.shape, packed.shape[0]
    check_packed(packed, fmt, k)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return y
    if config is None:
        config = default_gemv(fmt) if m == 1 else default_dot(fmt, m)
    bias_arg = bias if bias is not None else x
    common = dict(HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCKS=config.blocks,
                  num_warps=config.num_warps, **format_args(fmt, x.device), **launch.pdl(x.device))  # fmt: skip
    if isinstance(config, QGemvConfig):
        assert m == 1, m
        even = n % config.block_n == 0 and (k // fmt.qk) % config.blocks == 0
        _qgemv_kernel[(triton.cdiv(n, config.block_n),)](x, packed, bias_arg, y, n, k, packed.stride(0), EVEN=even,
                                                         **common)  # fmt: skip
        return y
    assert config.blocks * fmt.qk // fmt.parts >= 16, (fmt.name, config)  # a dot's K is at least 16
    assert config.split == 1 or y.is_contiguous(), "a split dot sums into a contiguous y"
    per_split, split = k_splits(k // fmt.qk, config.split, config.blocks)
    partial = partial_sums(y, split)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), split)
    _qdot_kernel[grid](
        x, packed, bias_arg, partial, m, n, k, x.stride(0), packed.stride(0), partial.stride(-2), per_split,
        PARTIAL=split > 1, BLOCK_M=config.block_m, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_stages=config.num_stages, **common,
    )  # fmt: skip
    return sum_splits(partial, bias, y)


def dequantize(packed: Tensor, fmt_name: str, k: int, dtype: torch.dtype, block_n: int = 16) -> Tensor:
    """``W`` [N, k] in ``dtype`` from its GGUF blocks ``packed`` [N, k / qk * nbytes]."""
    fmt = block_format(fmt_name)
    check_packed(packed, fmt, k)
    n = packed.shape[0]
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    blocks = max(1, 256 // fmt.qk)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // fmt.qk, blocks))
    if n and k:
        _dequant_kernel[grid](packed, out, n, k, packed.stride(0), out.stride(0), BLOCK_N=block_n, BLOCKS=blocks,
                              num_warps=4, **format_args(fmt, packed.device), **launch.pdl(packed.device))  # fmt: skip
    return out


MAX_PACKED_ROWS = 64  # past this many rows a product is compute-bound: the weight is dequantized for it


@dataclass(frozen=True)
class Dequantized:
    """The weight dequantized for the call, then a dense GEMM: a candidate beside the packed
    kernels' tiles (on the H200, 16 rows of a 1,024 x 4,096 Q4_K weight: 12.3 us against the
    dot kernel's 53.9 us; see benchmarks/RESULTS.md)."""


DEQUANTIZED = Dequantized()


def linear_rows(
    x: Tensor,
    packed: Tensor,
    fmt_name: str,
    bias: Tensor | None = None,
    config: QGemvConfig | QDotConfig | Dequantized | None = None,
) -> Tensor:
    """:func:`quant_linear` in ``config``'s tile, or through the dequantized weight for
    :data:`DEQUANTIZED` and, without a config, past :data:`MAX_PACKED_ROWS` rows (prefill: 512 rows
    of a 1,024 x 4,096 Q4_K weight take 15.8 us so against the dot kernel's 408 us)."""
    if isinstance(config, Dequantized) or (config is None and x.shape[0] > MAX_PACKED_ROWS):
        return F.linear(x, dequantize(packed, fmt_name, x.shape[1], x.dtype), bias)
    return quant_linear(x, packed, fmt_name, bias, config)
