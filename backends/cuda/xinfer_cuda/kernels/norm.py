"""RMSNorm, alone or fused with the residual add that precedes it; its output also quantized to int8 per block of
32 where an int8 kernel reads it next (:func:`~xinfer_cuda.kernels.plane_i8_dot.quantize_blocks`'s codes)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.plane_i8_dot import store_blocks


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    new_residual_ptr,
    q_ptr,
    d_ptr,
    s_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    QUANTIZE: tl.constexpr,
    ORDER: tl.constexpr,  # the codes' (quantize_blocks')
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # No kernel writes the weight: its load goes out before the wait for the kernel that
    # writes x (pdl_entry), not after the new residual's store, which it could alias.
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Round the sum to the input dtype before normalizing, like the reference does:
        # the rounded sum is what the next layer receives as its residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    out = (x * inv_rms * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
    if QUANTIZE:  # the codes of the output as stored (rounded to its dtype)
        blocks = tl.arange(0, BLOCK // 32)
        store_blocks(tl.reshape(out.to(tl.float32), (BLOCK // 32, 32)), q_ptr, d_ptr, s_ptr, row, blocks, n_cols // 32,
                     ORDER)  # fmt: skip


def _rows(x: Tensor) -> Tensor:
    """``x`` as [rows, cols] with unit column stride, a view where possible."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float,
    residual: Tensor | None = None,
    out: Tensor | None = None,
    new_residual: Tensor | None = None,
    quantized: tuple[Tensor, Tensor, Tensor] | None = None,
    order: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim of ``x``; with ``residual``, of ``x + residual``,
    returning ``(out, x + residual)``. With ``quantized`` (where
    :func:`~xinfer_cuda.kernels.plane_i8_dot.quantized_blocks` puts them; columns a multiple of
    32) also the output's int8 codes per block of 32 in ``order``, as
    :func:`~xinfer_cuda.kernels.plane_i8_dot.quantize_blocks` makes them."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    out2 = out.view(-1, n_cols)
    if residual is not None:
        r2 = _rows(residual)
        if new_residual is None:
            new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        nr2 = new_residual.view(-1, n_cols)
    else:
        r2 = nr2 = x2  # unused
    if x2.shape[0] == 0:
        return out if residual is None else (out, new_residual)
    block = max(32, triton.next_power_of_2(n_cols))
    num_warps = min(max(block // 512, 1), 16)
    q, d, s = quantized if quantized is not None else (out2,) * 3  # (unused)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight.contiguous(),
        out2,
        nr2,
        q,
        d,
        s,
        x2.stride(0),
        r2.stride(0),
        out2.stride(0),
        nr2.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        QUANTIZE=quantized is not None,
        ORDER=order,
        BLOCK=block,
        num_warps=num_warps,
        **launch.pdl(x.device),
    )
    return out if residual is None else (out, new_residual)


@triton.jit
def _layer_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    new_residual_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_new_residual,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the sum rounded to the input dtype, as the next residual is
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, x, mask=mask)
    x = x.to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    inv_std = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (centered * inv_std * w + b).to(out_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """LayerNorm over the last dim of ``x``; with ``residual``, of ``x + residual``, returning
    ``(out, x + residual)``. One launch."""
    n_cols = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2  # (x stands in where there is none)
    out2, nr2 = out.view(-1, n_cols), new_residual.view(-1, n_cols)
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(n_cols)
        _layer_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), bias.contiguous(), out2, nr2,
            x2.stride(0), r2.stride(0), out2.stride(0), nr2.stride(0), n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 16),
        )  # fmt: skip
    return out if residual is None else (out, new_residual)
