"""Gated activations: ``act(x[..., :n]) * x[..., n:]``, and sigmoid gates: ``sigmoid(gate) * y`` (an
attention's output gate) and ``base + sigmoid(x @ w.T) * y`` (a shared expert's, its one-row projection
computed by each program, with the sum of the routed experts' output), in fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
SQRT_HALF: tl.constexpr = tl.constexpr(0.7071067811865476)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
"""The kernels' name of each gated activation, by the config's."""


@triton.jit
def act(gate, ACTIVATION: tl.constexpr):
    """The activation :data:`ACTIVATIONS` names, of fp32 ``gate``."""
    if ACTIVATION == "silu":
        return gate * tl.sigmoid(gate)
    if ACTIVATION == "gelu":
        return 0.5 * gate * (1.0 + tl.erf(gate * SQRT_HALF))
    # gelu_tanh: 0.5 * x * (1 + tanh(y)) == x * sigmoid(2 * y), without a tanh
    y = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    return gate * tl.sigmoid(2.0 * y)


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
    tl.store(out_ptr + row * stride_out + cols, (act(gate, ACTIVATION) * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: Tensor, activation: str, out: Tensor | None = None) -> Tensor:
    """``act(x[..., :n]) * x[..., n:]`` for ``x`` [..., 2n], ``act`` by its kernel name (a value of
    :data:`ACTIVATIONS`)."""
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
    return act_and_mul(x, "silu", out)


def gelu_tanh_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``gelu_tanh(x[..., :n]) * x[..., n:]`` for ``x`` [..., 2n]."""
    return act_and_mul(x, "gelu_tanh", out)


def gelu_and_mul(x: Tensor, out: Tensor | None = None) -> Tensor:
    """``gelu(x[..., :n]) * x[..., n:]`` for ``x`` [..., 2n], the exact (erf) gelu."""
    return act_and_mul(x, "gelu", out)


@triton.jit
def _sigmoid_gate_kernel(
    y_ptr, gate_ptr, base_ptr, x_ptr, gate_weight_ptr, out_ptr, stride_y, stride_gate, stride_base, stride_x,
    stride_out, n, k, GATE_DOT: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``sigmoid(gate) * y``, or with ``GATE_DOT`` ``base + sigmoid(x . gate_weight) * y`` (a logit per row)."""
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    if GATE_DOT:
        logit = tl.zeros([BLOCK_K], dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + ks, mask=ks < k, other=0.0).to(tl.float32)
            logit += x * tl.load(gate_weight_ptr + ks, mask=ks < k, other=0.0).to(tl.float32)
        out = tl.load(base_ptr + row * stride_base + cols, mask=mask, other=0.0).to(tl.float32)
        out += tl.sigmoid(tl.sum(logit, axis=0)) * y
    else:
        out = tl.sigmoid(tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)) * y
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _unit_column_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def sigmoid_gate(y: Tensor, gate: Tensor) -> Tensor:
    """``sigmoid(gate) * y`` for ``y`` and ``gate`` [T, N], either a view with a row stride."""
    y, gate = _unit_column_stride(y), _unit_column_stride(gate)
    tokens, n = y.shape
    out = torch.empty(tokens, n, dtype=y.dtype, device=y.device)
    if tokens and n:
        block = min(triton.next_power_of_2(n), 1024)
        _sigmoid_gate_kernel[(tokens, triton.cdiv(n, block))](
            y, gate, y, y, y, out, y.stride(0), gate.stride(0), 0, 0, out.stride(0), n, 0,
            GATE_DOT=False, BLOCK=block, BLOCK_K=1, num_warps=4, **launch.pdl(y.device),
        )  # fmt: skip
    return out


def add_gated(base: Tensor, y: Tensor, x: Tensor, gate_weight: Tensor) -> Tensor:
    """``base + sigmoid(x @ gate_weight.T) * y`` for ``base``, ``y`` [T, N], ``x`` [T, K], ``gate_weight`` [1, K]."""
    base, y, x, gate_weight = (_unit_column_stride(t) for t in (base, y, x, gate_weight))
    tokens, n = base.shape
    out = torch.empty(tokens, n, dtype=base.dtype, device=base.device)
    if tokens and n:
        block = min(triton.next_power_of_2(n), 4096)  # each program computes its row's logit: whole rows
        _sigmoid_gate_kernel[(tokens, triton.cdiv(n, block))](
            y, y, base, x, gate_weight, out, y.stride(0), 0, base.stride(0), x.stride(0), out.stride(0), n,
            x.shape[-1], GATE_DOT=True, BLOCK=block, BLOCK_K=min(triton.next_power_of_2(x.shape[-1]), 1024),
            num_warps=8 if block >= 2048 else 4, **launch.pdl(base.device),
        )  # fmt: skip
    return out
