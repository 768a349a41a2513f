"""One-row linear ``y = x W^T (+ bias)``: every projection of a batch-1 decode step.

With one row a GEMM is a stream over ``W`` [N, K]: 2 N K FLOPs against N K weight
reads, so its time is the weight bytes over the memory bandwidth. Each program owns
``BLOCK_N`` rows of ``W`` and walks their K columns ``BLOCK_K`` at a time, keeping a
[BLOCK_N, BLOCK_K] fp32 accumulator that is summed once at the end. Bandwidth needs
bytes in flight: about ``N * BLOCK_K * 2`` bytes over all programs per step of the
loop (times ``unroll``), hence long K tiles where N is small. Which tile shape is fastest (or whether
cuBLAS is) depends on the shape and the GPU; :mod:`xinfer_cuda.linear` measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int
    unroll: int = 1  # K tiles whose loads are issued together

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
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, loop_unroll_factor=UNROLL):
        cols = k + tl.arange(0, BLOCK_K)
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
            x = tl.load(x_ptr + cols)
        else:
            w = tl.load(w_rows + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: Tensor, weight: Tensor, bias: Tensor | None, config: GemvConfig, out: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` for ``x`` [1, K] and ``weight`` [N, K], as [1, N]."""
    (num_rows, k), (n, _) = x.shape, weight.shape
    assert num_rows == 1 and weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape, weight.stride())
    x = x.contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, UNROLL=config.unroll, num_warps=config.num_warps,
    )  # fmt: skip
    return y
