"""Fused mixture of experts (:meth:`xinfer.ops.Ops.fused_moe`) over GGUF-packed expert stacks:
``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I], each stored as uint8
[E, rows, row bytes] in one block format (:mod:`xinfer_cuda.kernels.gguf_blocks`).

Per slot (a (token, chosen expert) pair ``s = t * k + j``), as the unquantized kernel's
small-batch path does (:mod:`xinfer_cuda.kernels.moe`), reading only the chosen experts:

- gate/up: a program per (slot, tile of I rows) takes the dot products of its token's row
  with the tile's gate rows and up rows (:func:`~xinfer_cuda.kernels.quant_linear.row_dots`)
  and stores ``act(gate) * up`` [T*k, I] in the activations' dtype;
- down: a program per (slot, tile of H rows) stores that row through the expert's down
  rows times the slot's routing weight, fp32 [T*k, H]; the k slots of a token are summed
  after.

No host syncs (steps are captured in CUDA graphs at any batch). An expert chosen by several
tokens of a step is read once per slot: past ``MAX_SLOTS`` slots (prefill), outside a graph
capture, :mod:`xinfer_cuda.quant_weights` takes the experts one by one instead
(:func:`expert_by_expert`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.activation import ACTIVATIONS, act
from xinfer_cuda.kernels.gguf_blocks import BlockFormat
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.quant_linear import block_format, format_args, linear_rows, row_dots

MAX_SLOTS = 256  # past that, outside a capture, expert by expert (quant_weights)
BLOCK_N = 4


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    h_ptr,
    INTER,
    K,
    stride_x,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    NBYTES: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTS: tl.constexpr,
    SPAN: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // TOP_K).to(tl.int64) * stride_x
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + expert * stride_we + rows[:, None, None].to(tl.int64) * stride_wn
    gate = row_dots(x_row, w_rows, rows, INTER, K, FMT, QK, NBYTES, GROUPS, PARTS, SPAN, EVEN, BLOCK_N, BLOCKS)
    up = row_dots(x_row, w_rows + INTER * stride_wn, rows, INTER, K, FMT, QK, NBYTES, GROUPS, PARTS, SPAN, EVEN, BLOCK_N,
                  BLOCKS)  # fmt: skip
    h = act(gate, ACTIVATION) * up
    tl.store(h_ptr + slot.to(tl.int64) * INTER + rows, h.to(h_ptr.dtype.element_ty), mask=rows < INTER)


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    weights_ptr,
    y_ptr,
    N,
    INTER,
    stride_we,
    stride_wn,
    FMT: tl.constexpr,
    QK: tl.constexpr,
    NBYTES: tl.constexpr,
    GROUPS: tl.constexpr,
    PARTS: tl.constexpr,
    SPAN: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    slot = tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + expert * stride_we + rows[:, None, None].to(tl.int64) * stride_wn
    h_row = h_ptr + slot.to(tl.int64) * INTER
    y = row_dots(h_row, w_rows, rows, N, INTER, FMT, QK, NBYTES, GROUPS, PARTS, SPAN, EVEN, BLOCK_N, BLOCKS)
    y *= tl.load(weights_ptr + slot).to(tl.float32)
    tl.store(y_ptr + slot.to(tl.int64) * N + rows, y, mask=rows < N)


def _launch_args(fmt: BlockFormat, rows: int, k: int, block_n: int, device: torch.device) -> dict:
    blocks = max(1, 256 // fmt.qk)
    even = rows % block_n == 0 and (k // fmt.qk) % blocks == 0
    return dict(
        EVEN=even, BLOCK_N=block_n, BLOCKS=blocks, num_warps=4, **format_args(fmt, device), **launch.pdl(device)
    )


def fused_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    fmt_name: str,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: str,
    block_n: int = BLOCK_N,
) -> Tensor:
    """:meth:`xinfer.ops.Ops.fused_moe` for ``x`` [T, H] and expert stacks packed in ``fmt_name``:
    ``w13`` uint8 [E, 2I, H / qk * nbytes], ``w2`` uint8 [E, H, I / qk * nbytes]; ``block_n``
    rows of an expert per program."""
    fmt = block_format(fmt_name)
    (tokens, hidden), top_k = x.shape, topk_ids.shape[1]
    experts, two_i, _ = w13.shape
    inter = two_i // 2
    assert w13.dtype == w2.dtype == torch.uint8 and w13.shape[2] == fmt.row_bytes(hidden), (w13.shape, fmt)
    assert w2.shape == (experts, hidden, fmt.row_bytes(inter)), (w2.shape, fmt)
    slots = tokens * top_k
    if slots == 0:
        return torch.empty_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids, weights = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
    h = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(triton.cdiv(inter, block_n), slots)](
        x, w13, ids, h, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), TOP_K=top_k,
        ACTIVATION=ACTIVATIONS[activation], **_launch_args(fmt, inter, hidden, block_n, x.device),
    )  # fmt: skip
    y = torch.empty(slots, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(triton.cdiv(hidden, block_n), slots)](
        h, w2, ids, weights, y, hidden, inter, w2.stride(0), w2.stride(1), **_launch_args(fmt, hidden, inter, block_n, x.device)
    )  # fmt: skip
    return y.view(tokens, top_k, hidden).sum(1).to(x.dtype)


def expert_by_expert(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    fmt_name: str,
    topk_weights: Tensor,
    topk_ids: Tensor,
    act_and_mul: Callable[[Tensor], Tensor],
) -> Tensor:
    """:func:`fused_moe` for many slots (prefill): each chosen expert's slots through
    :func:`linear_rows`, its weights read once; one host sync (the experts chosen), so not in a capture."""
    top_k = topk_ids.shape[1]
    ids, weights = topk_ids.flatten(), topk_weights.flatten().float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in ids.unique().tolist():
        slots = (ids == expert).nonzero().squeeze(1)  # (token, j) pairs routed to the expert
        tokens = slots // top_k
        h = act_and_mul(linear_rows(x[tokens], w13[expert], fmt_name))
        out.index_add_(0, tokens, linear_rows(h, w2[expert], fmt_name).float() * weights[slots, None])
    return out.to(x.dtype)
