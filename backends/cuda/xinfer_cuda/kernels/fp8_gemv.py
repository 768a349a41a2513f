"""One row of ``x`` times an FP8 weight in the tensor cores' layout (:mod:`xinfer_cuda.fp8_tensor_cores`: the
e4m3 codes [N, K] row-major, then a float32 scale per 128 columns of a row, [K / 128, N]), so that the layout
that ``scaled_mm`` reads for many rows also serves batch-1 decode without a second copy of the weight.

A warp owns a row: each of a step's 8 loads is 512 consecutive bytes of it (16 a lane: one load instruction, no
byte of a sector unused), so a step covers 4,096 columns. A lane converts its 16 codes to fp32, sums their
products with the activations in the thread, and scales that sum by its block's scale (a lane's 16 codes are in
one block of 128: 8 lanes share a scale). The per-row sums are added across the lanes once, at the end. The
first step's code loads go out before the wait on the kernel that writes ``x``. The slots (a lane's 16 columns
of a row each) are one flat index, laid out by Triton as written (the lanes the low 5 bits, then the warps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

BLOCK = tl.constexpr(128)  # columns a scale
STEP = tl.constexpr(4096)  # columns a warp's step: 8 loads of 32 lanes' 16 bytes
LOADS = tl.constexpr(8)


@triton.jit
def _codes(row_codes, rows, cols, N, K, EVEN: tl.constexpr):
    """A lane's 16 codes at ``cols`` of its row: [S, 16] bytes."""
    at = row_codes[:, None] + cols[:, None] + tl.arange(0, 16)[None, :]
    if EVEN:
        return tl.load(at, eviction_policy="evict_first")
    else:
        return tl.load(at, mask=((rows < N) & (cols < K))[:, None], other=0, eviction_policy="evict_first")


@triton.jit
def _products(codes, x_ptr, scales_ptr, rows, cols, N, K, EVEN: tl.constexpr):
    """The scaled sum of a lane's 16 products: [S] fp32."""
    e = tl.arange(0, 16)[None, :]
    if EVEN:
        x = tl.load(x_ptr + cols[:, None] + e)
        scale = tl.load(scales_ptr + (cols // BLOCK) * N + rows)
    else:
        x = tl.load(x_ptr + cols[:, None] + e, mask=(cols < K)[:, None], other=0.0)
        scale = tl.load(scales_ptr + (cols // BLOCK) * N + rows, mask=(rows < N) & (cols < K), other=0.0)
    values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.sum(values * x.to(tl.float32), axis=1) * scale


@triton.jit
def _step(acc, k0, x_ptr, row_codes, scales_ptr, rows, lane_cols, N, K, EVEN: tl.constexpr, WAIT: tl.constexpr):
    """``acc`` plus the products of the 4,096 columns from ``k0``: the 8 loads of codes first, then (``WAIT``) the
    wait for the kernel that writes ``x``, then the products."""
    codes = (_codes(row_codes, rows, k0 + lane_cols, N, K, EVEN),
             _codes(row_codes, rows, k0 + 512 + lane_cols, N, K, EVEN),
             _codes(row_codes, rows, k0 + 1024 + lane_cols, N, K, EVEN),
             _codes(row_codes, rows, k0 + 1536 + lane_cols, N, K, EVEN),
             _codes(row_codes, rows, k0 + 2048 + lane_cols, N, K, EVEN),
             _codes(row_codes, rows, k0 + 2560 + lane_cols, N, K, EVEN),
             _codes(row_codes, rows, k0 + 3072 + lane_cols, N, K, EVEN),
             _codes(row_codes, rows, k0 + 3584 + lane_cols, N, K, EVEN))  # fmt: skip
    pdl_entry(WAIT)
    for c in tl.static_range(LOADS):
        acc += _products(codes[c], x_ptr, scales_ptr, rows, k0 + 512 * c + lane_cols, N, K, EVEN)
    return acc


@triton.jit
def _fp8_gemv_kernel(x_ptr, codes_ptr, scales_ptr, bias_ptr, y_ptr, N, K, W: tl.constexpr, EVEN: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    slot = tl.arange(0, W * 32)  # lane l of warp w: slot 32 w + l
    rows = tl.program_id(0) * W + slot // 32
    row_codes = codes_ptr + rows.to(tl.int64) * K
    lane_cols = 16 * (slot % 32)
    acc = _step(tl.zeros((W * 32,), dtype=tl.float32), 0, x_ptr, row_codes, scales_ptr, rows, lane_cols, N, K,
                EVEN, PDL)  # fmt: skip
    for k0 in range(STEP, K, STEP):
        acc = _step(acc, k0, x_ptr, row_codes, scales_ptr, rows, lane_cols, N, K, EVEN, False)
    y = tl.sum(tl.reshape(acc, (W, 32)), axis=1)
    outs = tl.program_id(0) * W + tl.arange(0, W)
    if HAS_BIAS:
        y += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + outs, y.to(y_ptr.dtype.element_ty), mask=outs < N)


def fp8_gemv(x: Tensor, codes: Tensor, scales: Tensor, bias: Tensor | None = None, warps: int = 4) -> Tensor:
    """``x`` [1, K] times the weight whose e4m3 codes are ``codes`` [N, K] (uint8 or float8_e4m3fn) and whose
    scales are ``scales`` [K / 128, N] (float32, a scale per row and 128 columns): [1, N] in ``x``'s dtype."""
    (m, k), n = x.shape, codes.shape[0]
    assert m == 1 and codes.shape[1] == k and scales.shape == (k // BLOCK.value, n), (x.shape, codes.shape)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    even = n % warps == 0 and k % STEP.value == 0
    _fp8_gemv_kernel[(triton.cdiv(n, warps),)](
        x.contiguous(), codes.view(torch.uint8), scales, bias if bias is not None else y, y, n, k, W=warps,
        EVEN=even, HAS_BIAS=bias is not None, num_warps=warps, **launch.pdl(x.device),
    )  # fmt: skip
    return y
