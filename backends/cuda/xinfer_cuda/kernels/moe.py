"""Fused mixture of experts (see :meth:`xinfer.ops.Ops.fused_moe`): each (token, chosen
expert) pair, a *slot* ``s = t * k + j``, goes through its expert's gated MLP, and the
k slots of a token are summed weighted.

Two launches either way: gate/up with the activation fused (the slot's ``act(g) * u``
[I] into a [T*k, I] buffer), then down with the routing weight applied (the slot's
output [H], fp32, into a [T*k, H] buffer that a sum over k reduces).

- Grouped (prefill, larger batches): the slots are sorted by expert and cut into blocks
  of ``BLOCK_M`` slots of one expert (an expert's last block padded with slot ``T*k``,
  which no program stores). A program multiplies its block with a tile of its expert's
  weights on the tensor cores, so every expert's weights are read once per block, never
  per token. The grid is the most blocks any routing can need, sized from the shapes
  alone, and programs past the step's last block return: no host syncs, so steps are
  captured in CUDA graphs.
- Per slot (small decode batches, ``T*k <= MAX_SLOTS_PER_SLOT_PATH``): a program per
  (slot, tile of output rows) reads only the chosen expert's rows, as a GEMV does; no
  sorting.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(0.7978845608028654)
MAX_SLOTS_PER_SLOT_PATH = 32
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@triton.jit
def _act(gate, ACTIVATION: tl.constexpr):
    if ACTIVATION == "silu":
        return gate * tl.sigmoid(gate)
    # gelu_tanh: 0.5 * x * (1 + tanh(y)) == x * sigmoid(2 * y)
    y = SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
    return gate * tl.sigmoid(2.0 * y)


# ---- grouped: blocks of slots of one expert -------------------------------------------------------------------


@triton.jit
def _grouped_gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, block_slots_ptr, block_experts_ptr,
    num_slots, top_k, hidden, inter,
    stride_x, stride_we, stride_wn, stride_h,
    ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(block_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    tokens = (slots // top_k).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + tokens[:, None] * stride_x
    w_gate = w13_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < hidden), other=0.0)
        w_mask = (ks[:, None] < hidden) & (cols[None, :] < inter)
        gate = tl.dot(a, tl.load(w_gate + ks[:, None], mask=w_mask, other=0.0), gate, input_precision=PRECISION)
        up = tl.dot(a, tl.load(w_up + ks[:, None], mask=w_mask, other=0.0), up, input_precision=PRECISION)
    out = _act(gate, ACTIVATION) * up
    h = h_ptr + slots[:, None].to(tl.int64) * stride_h + cols[None, :]
    tl.store(h, out.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < inter))


@triton.jit
def _grouped_down_kernel(
    h_ptr, w2_ptr, weights_ptr, out_ptr, block_slots_ptr, block_experts_ptr,
    num_slots, hidden, inter,
    stride_h, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert < 0:
        return
    slots = tl.load(block_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = slots < num_slots
    rows = slots.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h_rows = h_ptr + rows[:, None] * stride_h
    w = w2_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(h_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < inter), other=0.0)
        w_mask = (ks[:, None] < inter) & (cols[None, :] < hidden)
        acc = tl.dot(a, tl.load(w + ks[:, None], mask=w_mask, other=0.0), acc, input_precision=PRECISION)
    acc *= tl.load(weights_ptr + rows, mask=valid, other=0.0)[:, None]
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(out, acc, mask=valid[:, None] & (cols[None, :] < hidden))


def align_blocks(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The slots sorted by expert in blocks of ``block_m`` slots of one expert: the slots of
    each block [num_blocks * block_m] (``T*k`` pads a block) and each block's expert
    [num_blocks] (-1: no block). ``num_blocks`` bounds every routing of these shapes, so
    nothing here waits for the device."""
    ids = topk_ids.flatten()
    num_slots = ids.numel()
    num_blocks = triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int64))
    blocks_per_expert = (counts + block_m - 1) // block_m
    first_block = torch.cumsum(blocks_per_expert, 0) - blocks_per_expert
    first_slot = torch.cumsum(counts, 0) - counts
    order = torch.sort(ids, stable=True).indices  # slots sorted by expert
    sorted_experts = ids[order].long()
    rank = torch.arange(num_slots, device=ids.device) - first_slot[sorted_experts]  # within its expert
    position = first_block[sorted_experts] * block_m + rank
    block_slots = torch.full((num_blocks * block_m,), num_slots, dtype=torch.int32, device=ids.device)
    block_slots.scatter_(0, position, order.to(torch.int32))
    last_block = torch.cumsum(blocks_per_expert, 0)  # one past each expert's blocks
    block_experts = torch.searchsorted(last_block, torch.arange(num_blocks, device=ids.device), right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1).to(torch.int32)
    return block_slots, block_experts


def _tiles(num_slots: int, num_experts: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): blocks about the size of an expert's share of slots."""
    block_m = 16 if num_slots <= 2 * 16 * num_experts else 64
    return (block_m, 64, 64) if device.type == "cuda" else (block_m, 32, 32)


def _grouped(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, topk_ids: Tensor, activation: str) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    num_slots = num_tokens * top_k
    block_m, block_n, block_k = _tiles(num_slots, num_experts, x.device)
    block_slots, block_experts = align_blocks(topk_ids, num_experts, block_m)
    num_blocks = block_experts.numel()
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    pdl = {**launch.pdl(x.device), "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32"}
    _grouped_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, block_slots, block_experts, num_slots, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl,
    )  # fmt: skip
    _grouped_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, weights, out, block_slots, block_experts, num_slots, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl,
    )  # fmt: skip
    return out


# ---- per slot: a GEMV over the chosen expert's rows ---------------------------------------------------------


@triton.jit
def _slot_gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, ids_ptr, top_k, hidden, inter,
    stride_x, stride_we, stride_wn, stride_h,
    ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    x_row = x_ptr + (slot // top_k) * stride_x
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_gate = w13_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_row + ks, mask=ks < hidden, other=0.0).to(tl.float32)[None, :]
        w_mask = (rows[:, None] < inter) & (ks[None, :] < hidden)
        gate += a * tl.load(w_gate + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        up += a * tl.load(w_up + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    out = _act(tl.sum(gate, axis=1), ACTIVATION) * tl.sum(up, axis=1)
    tl.store(h_ptr + slot * stride_h + rows, out.to(h_ptr.dtype.element_ty), mask=rows < inter)


@triton.jit
def _slot_down_kernel(
    h_ptr, w2_ptr, weights_ptr, out_ptr, ids_ptr, hidden, inter,
    stride_h, stride_we, stride_wn, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = w2_ptr + expert * stride_we + rows[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        ks = k + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + slot * stride_h + ks, mask=ks < inter, other=0.0).to(tl.float32)[None, :]
        w_mask = (rows[:, None] < hidden) & (ks[None, :] < inter)
        acc += a * tl.load(w + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
    out = tl.sum(acc, axis=1) * tl.load(weights_ptr + slot)
    tl.store(out_ptr + slot * stride_out + rows, out, mask=rows < hidden)


def _per_slot(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, topk_ids: Tensor, activation: str) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    _, hidden, inter = w2.shape
    num_slots = num_tokens * top_k
    ids = topk_ids.flatten()
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_slots, hidden, dtype=torch.float32, device=x.device)
    block_n, block_k = (32, 128) if x.device.type == "cuda" else (16, 32)
    pdl = launch.pdl(x.device)
    _slot_gate_up_kernel[(num_slots, triton.cdiv(inter, block_n))](
        x, w13, h, ids, top_k, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        ACTIVATION=ACTIVATIONS[activation], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl,
    )  # fmt: skip
    _slot_down_kernel[(num_slots, triton.cdiv(hidden, block_n))](
        h, w2, weights, out, ids, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **pdl,
    )  # fmt: skip
    return out


def fused_moe(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, activation: str) -> Tensor:
    """:meth:`xinfer.ops.Ops.fused_moe` in two launches (and, for larger batches, the
    torch ops that group the slots by expert)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.float().contiguous().flatten()
    path = _per_slot if num_tokens * top_k <= MAX_SLOTS_PER_SLOT_PATH else _grouped
    out = path(x, w13, w2, weights, topk_ids.contiguous(), activation)
    return out.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
