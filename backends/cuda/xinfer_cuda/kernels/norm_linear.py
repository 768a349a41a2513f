"""RMSNorm (with the residual add before it) fused into the prologue of the linear that
follows it, over one row or a few: ``y = rms_norm(x + residual) W^T (+ bias)``.

A decode step of a small batch runs a norm before most projections; as a kernel of its
own it moves a few KB and costs a launch (2-3 us in a CUDA graph, a good part of a
batch-1 layer). Here every program of the linear (:mod:`xinfer_cuda.kernels.gemv`'s
tiles: one row on the FMA units, up to 16 rows on the tensor cores) first sums the
squares of its rows of ``x + residual`` (a few KB, read from L2 by every program), then
normalizes each K tile of them before the product. Program 0 also writes the new
residual and the normalized rows, for the blocks that read them past this projection
(an MoE's experts, a second projection of the same input).

The normalized rows are rounded to the input dtype before the product, as the separate
norm's output was, and then to the weight's dtype (a router kept in fp32), so the result
is the unfused one's.

That costs every program a pass over ``x + residual`` before its first product, K / BLOCK_K
L2 round trips in a row at the head of a kernel of a few microseconds (and its reads of x
twice). A one-row tile with ``one_pass`` (weights in x's dtype) instead multiplies the
weights by ``h * norm_weight`` and sums ``h^2`` in the same loop, scaling its outputs by
the inverse root at the end: the product is of the unrounded normalized row, which differs
from the rounded one's by less than the output's own rounding. Its programs store the
normalized row and ``h`` a few columns each, loaded with their first tiles.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import arrivals, launch
from xinfer_cuda.kernels.arrivals import last_to_arrive
from xinfer_cuda.kernels.gemv import MAX_ROWS, DotConfig, GemvConfig, _weight_tile
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.moe_routing import route_constexprs, route_row, routed, shared_weight_of

if TYPE_CHECKING:
    from xinfer.layers.moe import Routing


@triton.jit
def _summed_tile(x_ptr, r_ptr, rows, stride_x, stride_r, k, M, K, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``rows`` of ``x + residual`` at the K tile ``k``, rounded to x's dtype as the
    residual stream is: [len(rows), BLOCK_K]."""
    cols = k + tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    h = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
    return h


@triton.jit
def _inverse_rms(x_ptr, r_ptr, rows, stride_x, stride_r, M, K, eps, HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_K: tl.constexpr):  # fmt: skip
    """``rsqrt(mean(h^2) + eps)`` of each row of ``h = x + residual``: [ROWS] fp32."""
    sum_sq = tl.zeros((ROWS,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        h = _summed_tile(x_ptr, r_ptr, rows, stride_x, stride_r, k, M, K, HAS_RESIDUAL, BLOCK_K).to(tl.float32)
        sum_sq += tl.sum(h * h, axis=1)
    return tl.rsqrt(sum_sq / K + eps)


@triton.jit
def _normed_tile(x_ptr, r_ptr, norm_w_ptr, normed_ptr, new_r_ptr, rows, inv_rms, stride_x, stride_r, stride_n, k, M, K,
                 write_rows, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The K tile at ``k`` of the normalized rows, in x's dtype; its first ``write_rows``
    rows (all in program 0, none in the others) are stored, and so is the residual sum."""
    cols = k + tl.arange(0, BLOCK_K)
    h = _summed_tile(x_ptr, r_ptr, rows, stride_x, stride_r, k, M, K, HAS_RESIDUAL, BLOCK_K)
    w = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    normed = (h.to(tl.float32) * inv_rms[:, None] * w[None, :]).to(h.dtype)
    at = rows[:, None] * stride_n + cols[None, :]
    written = (rows[:, None] < write_rows) & (cols[None, :] < K)
    tl.store(normed_ptr + at, normed, mask=written)
    if HAS_RESIDUAL:
        tl.store(new_r_ptr + at, h, mask=written)
    return normed


@triton.jit
def _norm_gemv_rows(
    x_ptr, r_ptr, norm_w_ptr, w_ptr, normed_ptr, new_r_ptr, N, K, stride_w, eps,
    HAS_RESIDUAL: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The program's ``BLOCK_N`` outputs of one row (fp32, without bias) and their indices."""
    pid = tl.program_id(0)
    outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + outs[:, None].to(tl.int64) * stride_w
    # No kernel writes the weights: the first tile's loads go out before the wait for
    # the kernel that writes x (pdl_entry), the others after it.
    w = _weight_tile(w_rows, outs, 0, N, K, EVEN_N and EVEN_K, BLOCK_K)
    pdl_entry(PDL)
    row = tl.arange(0, 1)
    writes = (pid == 0).to(tl.int32)  # rows written: 1 in program 0
    inv_rms = _inverse_rms(x_ptr, r_ptr, row, 0, 0, 1, K, eps, HAS_RESIDUAL, 1, BLOCK_K)
    x = _normed_tile(x_ptr, r_ptr, norm_w_ptr, normed_ptr, new_r_ptr, row, inv_rms, 0, 0, 0, 0, 1, K, writes,
                     HAS_RESIDUAL, BLOCK_K)  # fmt: skip
    acc = w.to(tl.float32) * x.to(w_ptr.dtype.element_ty).to(tl.float32)
    for k in tl.range(BLOCK_K, K, BLOCK_K, loop_unroll_factor=UNROLL):
        w = _weight_tile(w_rows, outs, k, N, K, EVEN_N and EVEN_K, BLOCK_K)
        x = _normed_tile(x_ptr, r_ptr, norm_w_ptr, normed_ptr, new_r_ptr, row, inv_rms, 0, 0, 0, k, 1, K, writes,
                         HAS_RESIDUAL, BLOCK_K)  # fmt: skip
        acc += w.to(tl.float32) * x.to(w_ptr.dtype.element_ty).to(tl.float32)
    return tl.sum(acc, axis=1), outs


@triton.jit
def _scaled_tile(x_ptr, r_ptr, norm_w_ptr, k, K, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """The K tile at ``k`` of the row ``h = x + residual`` and of ``h * norm_weight``, fp32: [1, BLOCK_K] each."""
    h = _summed_tile(x_ptr, r_ptr, tl.arange(0, 1), 0, 0, k, 1, K, HAS_RESIDUAL, BLOCK_K).to(tl.float32)
    cols = k + tl.arange(0, BLOCK_K)
    return h, h * tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _one_pass_rows(
    x_ptr, r_ptr, norm_w_ptr, w_ptr, normed_ptr, new_r_ptr, N, K, stride_w, eps,
    HAS_RESIDUAL: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, WRITE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """:func:`_norm_gemv_rows` in one pass over K: the products are of ``h * norm_weight``
    and the mean square of ``h`` is summed alongside, the outputs scaled by its inverse
    root at the end (not rounded to x's dtype first, as the normalized rows the other
    kernels multiply are: same weights' dtype only). Each program stores ``WRITE_BLOCK``
    columns of the normalized row and of ``h``, loaded before the loop."""
    pid = tl.program_id(0)
    outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + outs[:, None].to(tl.int64) * stride_w
    w = _weight_tile(w_rows, outs, 0, N, K, EVEN_N and EVEN_K, BLOCK_K)
    pdl_entry(PDL)
    row = tl.arange(0, 1)
    mine = pid * WRITE_BLOCK + tl.arange(0, WRITE_BLOCK)
    h_mine = _summed_tile(x_ptr, r_ptr, row, 0, 0, pid * WRITE_BLOCK, 1, K, HAS_RESIDUAL, WRITE_BLOCK)
    g_mine = tl.load(norm_w_ptr + mine, mask=mine < K, other=0.0).to(tl.float32)
    h, scaled = _scaled_tile(x_ptr, r_ptr, norm_w_ptr, 0, K, HAS_RESIDUAL, BLOCK_K)
    sum_sq = h * h
    acc = w.to(tl.float32) * scaled
    for k in tl.range(BLOCK_K, K, BLOCK_K, loop_unroll_factor=UNROLL):
        w = _weight_tile(w_rows, outs, k, N, K, EVEN_N and EVEN_K, BLOCK_K)
        h, scaled = _scaled_tile(x_ptr, r_ptr, norm_w_ptr, k, K, HAS_RESIDUAL, BLOCK_K)
        sum_sq += h * h
        acc += w.to(tl.float32) * scaled
    inv_rms = tl.rsqrt(tl.sum(sum_sq, axis=1) / K + eps)  # [1]
    normed = (h_mine.to(tl.float32) * inv_rms[:, None] * g_mine[None, :]).to(h_mine.dtype)
    tl.store(normed_ptr + mine[None, :], normed, mask=mine[None, :] < K)
    if HAS_RESIDUAL:
        tl.store(new_r_ptr + mine[None, :], h_mine, mask=mine[None, :] < K)
    return tl.sum(acc, axis=1) * inv_rms, outs


@triton.jit
def _norm_gemv_kernel(
    x_ptr,
    r_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    normed_ptr,
    new_r_ptr,
    N,
    K,
    stride_w,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr,
    ONE_PASS: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if ONE_PASS:
        y, outs = _one_pass_rows(x_ptr, r_ptr, norm_w_ptr, w_ptr, normed_ptr, new_r_ptr, N, K, stride_w, eps,
                                 HAS_RESIDUAL, EVEN_N, EVEN_K, BLOCK_N, BLOCK_K, UNROLL, WRITE_BLOCK, PDL)  # fmt: skip
    else:
        y, outs = _norm_gemv_rows(x_ptr, r_ptr, norm_w_ptr, w_ptr, normed_ptr, new_r_ptr, N, K, stride_w, eps,
                                  HAS_RESIDUAL, EVEN_N, EVEN_K, BLOCK_N, BLOCK_K, UNROLL, PDL)  # fmt: skip
    if HAS_BIAS:
        y += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + outs, y.to(y_ptr.dtype.element_ty), mask=outs < N)


@triton.jit
def _norm_route_kernel(
    x_ptr, r_ptr, norm_w_ptr, w_ptr, logits_ptr, normed_ptr, new_r_ptr, bias_ptr, weights_ptr, ids_ptr, counter_ptr,
    N, K, stride_w, eps, group_size, scaling_factor,
    HAS_RESIDUAL: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, SCORING: tl.constexpr, HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr, NUM_GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr,
    SHARED: tl.constexpr, SHARED_GATE: tl.constexpr, BLOCK_E: tl.constexpr, ONE_PASS: tl.constexpr,
    WRITE_BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A router's logits of one row (rounded to ``logits_ptr``'s dtype, the weight's, as the
    unfused op's are), and the last program to finish routes from them all (the ``N`` rows being
    the experts' and, where ``SHARED_GATE``, the shared experts' gate's)."""
    if ONE_PASS:
        y, outs = _one_pass_rows(x_ptr, r_ptr, norm_w_ptr, w_ptr, normed_ptr, new_r_ptr, N, K, stride_w, eps,
                                 HAS_RESIDUAL, EVEN_N, EVEN_K, BLOCK_N, BLOCK_K, UNROLL, WRITE_BLOCK, PDL)  # fmt: skip
    else:
        y, outs = _norm_gemv_rows(x_ptr, r_ptr, norm_w_ptr, w_ptr, normed_ptr, new_r_ptr, N, K, stride_w, eps,
                                  HAS_RESIDUAL, EVEN_N, EVEN_K, BLOCK_N, BLOCK_K, UNROLL, PDL)  # fmt: skip
    tl.store(logits_ptr + outs, y.to(logits_ptr.dtype.element_ty), mask=outs < N)
    if last_to_arrive(counter_ptr, tl.num_programs(0)):
        experts = tl.arange(0, BLOCK_E)
        num_experts = N - SHARED_GATE
        logits = tl.load(logits_ptr + experts, mask=experts < num_experts, other=-float("inf"), cache_modifier=".cg")
        route_row(logits.to(tl.float32), experts, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size,
                  scaling_factor, shared_weight_of(logits_ptr, num_experts, SHARED_GATE), SCORING, HAS_BIAS,
                  RENORMALIZE, NUM_GROUPS, TOPK_GROUPS, TOP_K, SHARED)  # fmt: skip


@triton.jit
def _norm_dot_kernel(
    x_ptr,
    r_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    normed_ptr,
    new_r_ptr,
    M,
    N,
    K,
    stride_x,
    stride_r,
    stride_n,
    stride_w,
    stride_y,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    pid = tl.program_id(0)
    rows = tl.arange(0, 16)  # of x and y
    outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of W, columns of y
    w_cols = w_ptr + outs[None, :].to(tl.int64) * stride_w  # W^T tiles [BLOCK_K, BLOCK_N]
    writes = M * (pid == 0).to(tl.int32)  # rows written: all in program 0
    inv_rms = _inverse_rms(x_ptr, r_ptr, rows, stride_x, stride_r, M, K, eps, HAS_RESIDUAL, 16, BLOCK_K)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = _normed_tile(x_ptr, r_ptr, norm_w_ptr, normed_ptr, new_r_ptr, rows, inv_rms, stride_x, stride_r,
                         stride_n, k, M, K, writes, HAS_RESIDUAL, BLOCK_K)  # fmt: skip
        ks = k + tl.arange(0, BLOCK_K)
        if EVEN_N and EVEN_K:
            w = tl.load(w_cols + ks[:, None], eviction_policy="evict_first")
        else:
            w = tl.load(w_cols + ks[:, None], mask=(outs[None, :] < N) & (ks[:, None] < K), other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
        acc = tl.dot(x.to(w.dtype), w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rows[:, None] * stride_y + outs[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (outs[None, :] < N))


def norm_linear(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    bias: Tensor | None,
    config: GemvConfig | DotConfig,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, normed, h)``: ``h = x + residual`` (``x`` without one), ``normed =
    rms_norm(h) * norm_weight`` in x's dtype, ``y = normed @ weight.T + bias`` in the
    weight's dtype, for ``x`` [M, K] (M = 1 for a :class:`GemvConfig`, at most
    :data:`MAX_ROWS` for a :class:`DotConfig`)."""
    (m, k), (n, _) = x.shape, weight.shape
    assert weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape, weight.stride())
    x = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    y = torch.empty(m, n, dtype=weight.dtype, device=x.device)
    normed = torch.empty(m, k, dtype=x.dtype, device=x.device)
    h = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None else x
    common = dict(HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, EVEN_N=n % config.block_n == 0,
                  EVEN_K=k % config.block_k == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                  num_warps=config.num_warps, **launch.pdl(x.device))  # fmt: skip
    r = residual if residual is not None else x  # (unused without a residual)
    bias_arg = bias if bias is not None else weight
    grid = (triton.cdiv(n, config.block_n),)
    if isinstance(config, GemvConfig):
        assert m == 1, m
        _norm_gemv_kernel[grid](x, r, norm_weight, weight, bias_arg, y, normed, h, n, k, weight.stride(0), eps,
                                UNROLL=config.unroll, **_pass_options(config, x, weight, grid[0]), **common)  # fmt: skip
    else:
        assert m <= MAX_ROWS, m
        _norm_dot_kernel[grid](
            x, r, norm_weight, weight, bias_arg, y, normed, h, m, n, k, x.stride(0), r.stride(0), normed.stride(0),
            weight.stride(0), y.stride(0), eps,
            PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", num_stages=config.num_stages, **common,
        )  # fmt: skip
    return y, normed, h


def norm_route(
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: Tensor,
    routing: Routing,
    correction_bias: Tensor | None,
    config: GemvConfig,
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """:meth:`xinfer.ops.Ops.norm_route` of one row ``x`` [1, K] in one launch: the router's
    GEMV with the norm in its prologue, the routing (:func:`moe_routing.route_row
    <xinfer_cuda.kernels.moe_routing.route_row>`) in the last program's epilogue. None
    inside a CUDA graph capture that has no counter for it (the caller runs the ops apart)."""
    (m, k), (n, _) = x.shape, weight.shape
    assert m == 1 and weight.shape[1] == k and weight.stride(1) == 1, (x.shape, weight.shape, weight.stride())
    counter = arrivals.counters(x.device, "norm_route", 1)
    if counter is None:
        return None
    x = x if x.stride(1) == 1 else x.contiguous()
    if residual is not None and residual.stride(1) != 1:
        residual = residual.contiguous()
    logits = torch.empty(n, dtype=weight.dtype, device=x.device)
    normed = torch.empty(m, k, dtype=x.dtype, device=x.device)
    h = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual is not None else x
    weights, ids = routed(m, routing, x.device)
    num_experts = n - routing.shared_gate
    route = route_constexprs(routing, num_experts, correction_bias is not None)
    bias = correction_bias if correction_bias is not None else weights  # (unread)
    _norm_route_kernel[(triton.cdiv(n, config.block_n),)](
        x, residual if residual is not None else x, norm_weight, weight, logits, normed, h, bias, weights, ids, counter,
        n, k, weight.stride(0), eps, num_experts // routing.num_groups, routing.scaling_factor,
        HAS_RESIDUAL=residual is not None, EVEN_N=n % config.block_n == 0, EVEN_K=k % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, UNROLL=config.unroll, num_warps=config.num_warps,
        **route, **_pass_options(config, x, weight, triton.cdiv(n, config.block_n)), **launch.pdl(x.device),
    )  # fmt: skip
    return weights, ids, normed, h


def _pass_options(config: GemvConfig, x: Tensor, weight: Tensor, programs: int) -> dict[str, object]:
    """``ONE_PASS`` and its ``WRITE_BLOCK``: the columns of the normalized row and of ``h``
    each of the ``programs`` stores, all of them together covering the row."""
    assert not config.one_pass or weight.dtype == x.dtype, "one pass: the normalized rows are not rounded"
    write_block = triton.next_power_of_2(triton.cdiv(x.shape[1], programs)) if config.one_pass else 1
    return {"ONE_PASS": config.one_pass, "WRITE_BLOCK": write_block}
