"""Gated activations: ``act(x[..., :n]) * x[..., n:]``, and sigmoid gates ``sigmoid(gate) * y (+ base)``
(an attention's output gate; a shared expert's, with the sum of the routed experts' output), in fp32."""

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


@triton.jit
def _sigmoid_gate_kernel(
    y_ptr, gate_ptr, base_ptr, out_ptr, stride_y, stride_gate, stride_gate_col, stride_base, stride_out, n,
    HAS_BASE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_ptr + row * stride_gate + cols * stride_gate_col, mask=mask, other=0.0).to(tl.float32)
    out = tl.sigmoid(gate) * tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BASE:
        out += tl.load(base_ptr + row * stride_base + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def sigmoid_gate(y: Tensor, gate: Tensor, base: Tensor | None = None) -> Tensor:
    """``sigmoid(gate) * y (+ base)`` for ``y`` [T, N], ``gate`` [T, N] or [T, 1], ``base`` [T, N]; any
    of them may be a view with a row stride."""
    y, gate = (t if t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous() for t in (y, gate))
    if base is not None and base.stride(-1) != 1:
        base = base.contiguous()
    tokens, n = y.shape
    out = torch.empty(tokens, n, dtype=y.dtype, device=y.device)
    if tokens == 0 or n == 0:
        return out
    block = min(triton.next_power_of_2(n), 1024)
    _sigmoid_gate_kernel[(tokens, triton.cdiv(n, block))](
        y, gate, y if base is None else base, out, y.stride(0), gate.stride(0), 0 if gate.shape[-1] == 1 else 1,
        0 if base is None else base.stride(0), out.stride(0), n,
        HAS_BASE=base is not None, BLOCK=block, num_warps=4, **launch.pdl(y.device),
    )  # fmt: skip
    return out
