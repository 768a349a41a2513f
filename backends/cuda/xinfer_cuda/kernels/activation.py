"""Gated activations: ``act(x[..., :n]) * x[..., n:]``, in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    n,
    ACTIVATION: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        act = gate * tl.sigmoid(gate)
    else:
        # gelu_tanh: 0.5 * x * (1 + tanh(y)) == x * sigmoid(2 * y), without a tanh.
        y = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * y)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: Tensor, activation: str, out: Tensor | None) -> Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if x2.shape[0] == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    grid = (x2.shape[0], triton.cdiv(n, block))
    _act_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), n,
        ACTIVATION=activation, BLOCK=block, num_warps=4, **launch.pdl(x.device),
    )  # fmt: skip
    return out


def silu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for ``x`` [..., 2n]."""
    return _act_and_mul(x, "silu", out)


def gelu_tanh_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``gelu_tanh(x[..., :n]) * x[..., n:]`` for ``x`` [..., 2n]."""
    return _act_and_mul(x, "gelu_tanh", out)
