"""Linear ``y = x W^T (+ bias)`` over one row or a few: the projections of decode steps
of small batches.

With M rows (M up to 16) a GEMM is a stream over ``W`` [N, K]: 2 M N K FLOPs against
N K weight reads, so its time is the weight bytes over the memory bandwidth, and the
kernel's job is to keep enough of them in flight. Two kernels, each program owning
``BLOCK_N`` rows of ``W`` and walking their K columns ``BLOCK_K`` at a time:

- one row (:class:`GemvConfig`): a [BLOCK_N, BLOCK_K] fp32 accumulator of products on
  the FMA units, summed once at the end; ``unroll`` K tiles' loads issued together;
- up to 16 rows (:class:`DotConfig`): a tensor-core dot per K tile (the rows padded to
  16), its weight loads pipelined ``num_stages`` deep.

Which tile shape is fastest (or whether cuBLAS is) depends on the shape and the GPU;
:mod:`xinfer_cuda.linear` measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

MAX_ROWS = 16  # the dot's smallest M


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    unroll: int = 1  # K tiles whose loads are issued together
    # a norm fused in front (kernels/norm_linear.py): its mean square summed in the product's loop
    one_pass: bool = False


@dataclass(frozen=True)
class DotConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _weight_tile(w_rows, rows, k, N, K, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K tile at ``k`` of the program's weight rows: [BLOCK_N, BLOCK_K]."""
    cols = k + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
    return tl.load(w_rows + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0,
                   eviction_policy="evict_first")  # fmt: skip


@triton.jit
def _x_tile(x_ptr, rows, k, K, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K tile at ``k`` of the row ``x``, a copy for each of the ``rows``: [BLOCK_N, BLOCK_K]. Loaded in the
    weight tile's shape, it gets the weight tile's layout, and each thread loads the columns it multiplies (from
    L1) instead of a [BLOCK_K] tile being moved into that layout through shared memory, two barriers a tile."""
    cols = k + tl.arange(0, BLOCK_K)[None, :] + 0 * rows[:, None]
    if EVEN:
        return tl.load(x_ptr + cols)
    return tl.load(x_ptr + cols, mask=cols < K, other=0.0)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    N,
    K,
    stride_w,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    # No kernel writes the weights: the first tile's loads go out before the wait for
    # the kernel that writes x (pdl_entry), the others after it.
    w = _weight_tile(w_rows, rows, 0, N, K, EVEN_N and EVEN_K, BLOCK_K)
    pdl_entry(PDL)
    x = _x_tile(x_ptr, rows, 0, K, EVEN_K, BLOCK_K)
    acc = w.to(tl.float32) * x.to(tl.float32)
    for k in tl.range(BLOCK_K, K, BLOCK_K, loop_unroll_factor=UNROLL):
        w = _weight_tile(w_rows, rows, k, N, K, EVEN_N and EVEN_K, BLOCK_K)
        x = _x_tile(x_ptr, rows, k, K, EVEN_K, BLOCK_K)
        acc += w.to(tl.float32) * x.to(tl.float32)
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _dot_kernel(
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
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    rows = tl.arange(0, 16)  # of x and y
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W, columns of y
    w_cols = w_ptr + outs[None, :].to(tl.int64) * stride_w  # W^T tiles [BLOCK_K, BLOCK_N]
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)  # fmt: skip
        if EVEN_N and EVEN_K:
            w = tl.load(w_cols + ks[:, None], eviction_policy="evict_first")
        else:
            w = tl.load(w_cols + ks[:, None], mask=(outs[None, :] < N) & (ks[:, None] < K), other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows[:, None] * stride_y + outs[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (outs[None, :] < N))


def gemv(
    x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig | DotConfig, out: Tensor | None = None
) -> Tensor:
    """``x @ weight.T + bias`` for ``x`` [M, K] (M = 1 for a :class:`GemvConfig`, at
    most :data:`MAX_ROWS` for a :class:`DotConfig`) and ``weight`` [N, K], as [M, N]."""
    (m, k), (n, _) = x.shape, weight.shape
    assert weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape, weight.stride())
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    grid = (triton.cdiv(n, config.block_n),)
    common = dict(HAS_BIAS=bias is not None, EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
                  BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
                  **launch.pdl(x.device))  # fmt: skip
    bias_arg = bias if bias is not None else weight
    if isinstance(config, GemvConfig):
        assert m == 1, m
        _gemv_kernel[grid](x, weight, bias_arg, y, n, k, weight.stride(0), UNROLL=config.unroll, **common)
    else:
        assert m <= MAX_ROWS, m
        _dot_kernel[grid](
            x, weight, bias_arg, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_stages=config.num_stages, **common,
        )  # fmt: skip
    return y
