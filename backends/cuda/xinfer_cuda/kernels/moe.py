"""Fused mixture of experts (see :meth:`xinfer.ops.Ops.fused_moe`): each (token, chosen
expert) pair, a *slot* ``s = t * k + j``, goes through its expert's gated MLP, and the
k slots of a token are summed weighted.

Two GEMM launches either way: gate/up with the activation fused (the slot's ``act(g) * u``
[I] into a [T*k, I] buffer), then down with the routing weight and the sum over the k
slots fused, so that no [T*k, H] buffer is written and read back.

- Per slot (small decode batches, ``T*k <= MAX_SLOTS_PER_SLOT_PATH``): gate/up runs a
  program per (slot, tile of I rows), down a program per (token, tile of H rows) over
  the token's k experts that writes the model dtype; both read only the chosen experts'
  rows, as a GEMV does. At batch 1 a layer's experts are ~75 MB (Qwen3-30B-A3B), ~18 µs
  at 4.2 TB/s, and each program only a few loop steps, so what decides the time is the
  bytes in flight: the next step's weights load while this step's are multiplied, and
  down's first ones before gate/up has finished (:class:`SlotTiles` has the variants,
  down split over slots and chunks of I among them, or gate/up and down in one launch;
  benchmarks/moe_kernels.py times them, and xinfer_cuda/moe_tiles.py picks among them
  at start-up). Down's row tiles shrink with the batch so that even one token spreads
  over every SM.
- Grouped (prefill, larger batches): the slots are grouped by expert into blocks of
  ``BLOCK_M`` slots of one expert (an expert's last block padded with slot ``T*k``,
  which no program stores) by two small kernels (:func:`align_blocks`). A program
  multiplies its block with a tile of its expert's weights on the tensor cores, so
  every expert's weights are read once per block, never per token; down adds its
  weighted rows into a zeroed fp32 [T, H] with atomics, which costs ``T*k*H*4`` bytes
  of atomics that stay in L2 instead of a [T*k, H] buffer written, read and summed
  (:func:`_grouped_tiles` gives the tile reasoning). The grid is the most blocks any
  routing can need, sized from the shapes alone, and programs past the step's last
  block return: no host syncs, so steps are captured in CUDA graphs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import arrivals, launch
from xinfer_cuda.kernels.activation import ACTIVATIONS, act, act_and_mul
from xinfer_cuda.kernels.arrivals import last_to_arrive
from xinfer_cuda.kernels.launch import pdl_entry

MAX_SLOTS_PER_SLOT_PATH = 32
Linear = Callable[[Tensor, Tensor], Tensor]  # x [T, K], weight [N, K] -> [T, N]


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
    out = act(gate, ACTIVATION) * up
    h = h_ptr + slots[:, None].to(tl.int64) * stride_h + cols[None, :]
    tl.store(h, out.to(h_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < inter))


@triton.jit
def _grouped_down_kernel(
    h_ptr, w2_ptr, weights_ptr, out_ptr, block_slots_ptr, block_experts_ptr,
    num_slots, top_k, hidden, inter,
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
    out = out_ptr + (rows // top_k)[:, None] * stride_out + cols[None, :]
    tl.atomic_add(out, acc, mask=valid[:, None] & (cols[None, :] < hidden), sem="relaxed")


@triton.jit
def _rank_slots_kernel(
    ids_ptr, counts_ptr, ranks_ptr, num_slots, num_experts, BLOCK_S: tl.constexpr, PDL: tl.constexpr
):
    """Each slot's rank among its expert's slots (in no set order), and the experts' counts."""
    pdl_entry(PDL)
    slots = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    experts = tl.load(ids_ptr + slots, mask=slots < num_slots, other=num_experts)
    valid = experts < num_experts
    ranks = tl.atomic_add(counts_ptr + experts, 1, mask=valid, sem="relaxed")
    tl.store(ranks_ptr + slots, ranks, mask=valid)


@triton.jit
def _place_slots_kernel(
    ids_ptr, counts_ptr, ranks_ptr, block_slots_ptr, block_experts_ptr, num_slots, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``BLOCK`` slots into their places in their experts' blocks, and ``BLOCK`` blocks'
    experts and pads. Every program sums the experts' block counts itself, so that none
    waits on another."""
    pdl_entry(PDL)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    end_block = tl.cumsum(blocks, axis=0)  # one past each expert's blocks
    first_block = end_block - blocks

    slots = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot_experts = tl.load(ids_ptr + slots, mask=slots < num_slots, other=num_experts)
    valid = slot_experts < num_experts
    before = experts[None, :] < slot_experts[:, None]
    slot_first_block = tl.sum(tl.where(before, blocks[None, :], 0), axis=1)
    position = slot_first_block * BLOCK_M + tl.load(ranks_ptr + slots, mask=valid, other=0)
    tl.store(block_slots_ptr + position, slots, mask=valid)

    block = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    block_expert = tl.sum((end_block[None, :] <= block[:, None]).to(tl.int32), axis=1)  # searchsorted, right
    mine = experts[None, :] == block_expert[:, None]
    count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1)
    rank = (block - tl.sum(tl.where(mine, first_block[None, :], 0), axis=1)) * BLOCK_M
    rank = rank[:, None] + tl.arange(0, BLOCK_M)[None, :]
    pad = (rank >= count[:, None]) & (block < num_blocks)[:, None]
    tl.store(block_slots_ptr + block[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :], num_slots, mask=pad)
    block_expert = tl.where(block_expert < num_experts, block_expert, -1)
    tl.store(block_experts_ptr + block, block_expert, mask=block < num_blocks)


def align_blocks(topk_ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor]:
    """The slots grouped by expert in blocks of ``block_m`` slots of one expert: the slots of
    each block [num_blocks * block_m] (``T*k`` pads a block) and each block's expert
    [num_blocks] (-1: no block); a slot whose id is ``num_experts`` or more is in none (an
    expert computed apart). ``num_blocks`` bounds every routing of these shapes, so nothing
    here waits for the device; two launches after a memset of the counts."""
    ids = topk_ids.flatten()
    num_slots = ids.numel()
    num_blocks = triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=ids.device)
    ranks = torch.empty(num_slots, dtype=torch.int32, device=ids.device)
    block_slots = torch.empty(num_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=ids.device)
    pdl = launch.pdl(ids.device)
    block_s = 256
    _rank_slots_kernel[(triton.cdiv(num_slots, block_s),)](
        ids, counts, ranks, num_slots, num_experts, BLOCK_S=block_s, **pdl
    )
    block_e = triton.next_power_of_2(num_experts)
    block = max(16, 8192 // block_e)  # [block, BLOCK_E] tiles
    _place_slots_kernel[(triton.cdiv(max(num_slots, num_blocks), block),)](
        ids, counts, ranks, block_slots, block_experts, num_slots, num_experts, num_blocks,
        BLOCK_M=block_m, BLOCK=block, BLOCK_E=block_e, **pdl,
    )  # fmt: skip
    return block_slots, block_experts


def gpu_tiles(x: Tensor) -> bool:
    """Whether launches on ``x`` take the GPU's tiles; under the interpreter small tiles run
    faster (tests/backends/compile_check.py answers True to compile what a GPU runs)."""
    return x.device.type == "cuda"


def _grouped_tiles(num_slots: int, num_experts: int, x: Tensor) -> dict[str, int]:
    """Tiles of the grouped GEMMs. ``BLOCK_M`` holds about all of an expert's slots (mean
    ``m = T*k/E`` plus three of its Poisson deviations, 16..128), so that each expert's
    weights are read about once per step. A 256-row decode step of Qwen3-30B-A3B
    (m = 16, ``BLOCK_M`` 32) is memory-bound: all 128 experts' 1.2 GB per layer read once
    take ~280 µs at 4.2 TB/s, its 19 GFLOP ~30 µs on the tensor cores even with half
    the rows padding; there 64 columns by 128 of K (bf16) and 3 stages keep ~100 KB of
    weights in flight per SM. Prefill (m in the hundreds) is compute-bound: 64- or
    128-row blocks with 8 warps reuse each weight tile over more rows. K tiles halve
    for fp32, to stay within shared memory."""
    mean = num_slots / num_experts
    block_m = min(128, max(16, triton.next_power_of_2(math.ceil(mean + 3 * math.sqrt(mean)))))
    if not gpu_tiles(x):
        return {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 32}
    k_bytes = 256 if block_m <= 32 else 128  # a K tile's bytes per row
    tiles = {"BLOCK_M": block_m, "BLOCK_K": k_bytes // x.element_size(), "num_stages": 3}
    if block_m <= 32:
        return {**tiles, "BLOCK_N": 64, "num_warps": 4}
    return {**tiles, "BLOCK_N": 128 if block_m == 64 else 64, "num_warps": 8}


def _grouped(x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, topk_ids: Tensor, activation: str,
             shared_experts: int, linear: Linear) -> Tensor:  # fmt: skip
    """The grouped kernels for the routed experts; the ``shared_experts`` that every token takes
    (the last experts and slots) too where the tokens fit one block (each shared expert's weights
    read once, and no launch of their own), else as dense GEMMs (``linear``) over all the tokens
    beside them: grouped, each would be a block per ``BLOCK_M`` tokens, every block reading all of
    its weights."""
    num_tokens, top_k = topk_ids.shape
    _, hidden, inter = w2.shape
    num_experts, routed_k = w2.shape[0] - shared_experts, top_k - shared_experts
    num_slots = num_tokens * top_k
    tiles = _grouped_tiles(num_tokens * routed_k, num_experts, x)
    if num_tokens <= tiles["BLOCK_M"]:
        num_experts, shared_experts = num_experts + shared_experts, 0
    block_slots, block_experts = align_blocks(topk_ids, num_experts, tiles["BLOCK_M"])  # (slots computed apart in none)
    num_blocks = block_experts.numel()
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    options = {**tiles, **launch.pdl(x.device), "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32"}
    _grouped_gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, w13, h, block_slots, block_experts, num_slots, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), ACTIVATION=ACTIVATIONS[activation], **options,
    )  # fmt: skip
    _grouped_down_kernel[(num_blocks, triton.cdiv(hidden, tiles["BLOCK_N"]))](
        h, w2, weights, out, block_slots, block_experts, num_slots, top_k, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0), **options,
    )  # fmt: skip
    if shared_experts:
        for j, y in enumerate(_every_tokens(x, w13[num_experts:], w2[num_experts:], activation, linear)):
            out.addcmul_(y, weights[:, routed_k + j, None])
    return out.to(x.dtype)


def _every_tokens(x: Tensor, w13: Tensor, w2: Tensor, activation: str, linear: Linear) -> Tensor:
    """Each of the experts ``w13`` [n, 2I, H], ``w2`` [n, H, I] on all of ``x`` [T, H], as
    ``linear`` GEMMs (gate/up of all n in one; the down projections of several in a cuBLAS
    bmm): [n, T, H] in x's dtype."""
    n, two_inter, hidden = w13.shape
    gate_up = linear(x, w13.reshape(n * two_inter, hidden)).unflatten(1, (n, two_inter))  # [T, n, 2I]
    h = act_and_mul(gate_up, ACTIVATIONS[activation])  # [T, n, I]
    if n == 1:
        return linear(h[:, 0], w2[0])[None]
    return torch.bmm(h.transpose(0, 1), w2.transpose(1, 2))


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
    out = act(tl.sum(gate, axis=1), ACTIVATION) * tl.sum(up, axis=1)
    tl.store(h_ptr + slot * stride_h + rows, out.to(h_ptr.dtype.element_ty), mask=rows < inter)


@triton.jit
def _token_down_kernel(
    h_ptr, w2_ptr, weights_ptr, out_ptr, ids_ptr, top_k, hidden, inter,
    stride_h, stride_we, stride_wn, stride_out,
    BLOCK_J: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A tile of a token's output rows: the weighted sum over its k slots, in fp32. The k
    experts' rows are one [BLOCK_J, BLOCK_N, BLOCK_K] tile, so that each step of the loop
    has all k experts' weights in flight at once, not one expert's after another's."""
    pdl_entry(PDL)
    token = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_J)
    slots = token * top_k + j
    chosen = j < top_k
    experts = tl.load(ids_ptr + slots, mask=chosen, other=0).to(tl.int64)
    weights = tl.load(weights_ptr + slots, mask=chosen, other=0.0).to(tl.float32)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = w2_ptr + experts[:, None, None] * stride_we + rows[None, :, None].to(tl.int64) * stride_wn
    h = h_ptr + slots[:, None, None] * stride_h
    w_rows = chosen[:, None, None] & (rows[None, :, None] < hidden)
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        ks = (k + tl.arange(0, BLOCK_K))[None, None, :]
        a = tl.load(h + ks, mask=chosen[:, None, None] & (ks < inter), other=0.0).to(tl.float32)
        acc += a * tl.load(w + ks, mask=w_rows & (ks < inter), other=0.0, eviction_policy="evict_first")
    out = tl.sum(tl.sum(acc, axis=2) * weights[:, None], axis=0)
    tl.store(out_ptr + token * stride_out + rows, out.to(out_ptr.dtype.element_ty), mask=rows < hidden)


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, h_ptr, ids_ptr, top_k, hidden, inter,
    stride_x, stride_we, stride_wn, stride_h,
    ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNROLL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """:func:`_slot_gate_up_kernel` with the next step's weight tiles loading while this step's are multiplied."""
    pdl_entry(PDL)
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = _gated_rows(x_ptr + (slot // top_k) * stride_x, w13_ptr + expert * stride_we, rows, hidden, inter, stride_wn,
                      ACTIVATION, BLOCK_K, UNROLL)  # fmt: skip
    tl.store(h_ptr + slot * stride_h + rows, out.to(h_ptr.dtype.element_ty), mask=rows < inter)


@triton.jit
def _gated_rows(x_row, w13, rows, hidden, inter, stride_wn, ACTIVATION: tl.constexpr, BLOCK_K: tl.constexpr,
                UNROLL: tl.constexpr):  # fmt: skip
    """``act(gate) * up`` of one token ``x_row`` for rows ``rows`` of I of one expert's ``w13``
    [2I, H]: [len(rows)] fp32, the next step's weight tiles loading while this step's are multiplied."""
    w_gate = w13 + rows[:, None].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    in_rows = rows[:, None] < inter
    x_rows = x_row + 0 * rows[:, None]  # x in the weights' shape: their layout, no conversion each step
    first = tl.arange(0, BLOCK_K)[None, :]
    gate_w = tl.load(w_gate + first, mask=in_rows & (first < hidden), other=0.0, eviction_policy="evict_first")
    up_w = tl.load(w_up + first, mask=in_rows & (first < hidden), other=0.0, eviction_policy="evict_first")
    gate = tl.zeros(gate_w.shape, dtype=tl.float32)
    up = tl.zeros(gate_w.shape, dtype=tl.float32)
    for k in tl.range(0, hidden, BLOCK_K, loop_unroll_factor=UNROLL):
        ks = k + tl.arange(0, BLOCK_K)
        next_ks = ks[None, :] + BLOCK_K
        next_mask = in_rows & (next_ks < hidden)
        next_gate_w = tl.load(w_gate + next_ks, mask=next_mask, other=0.0, eviction_policy="evict_first")
        next_up_w = tl.load(w_up + next_ks, mask=next_mask, other=0.0, eviction_policy="evict_first")
        a = tl.load(x_rows + ks[None, :], mask=in_rows & (ks[None, :] < hidden), other=0.0).to(tl.float32)
        gate += a * gate_w
        up += a * up_w
        gate_w, up_w = next_gate_w, next_up_w
    return act(tl.sum(gate, axis=1), ACTIVATION) * tl.sum(up, axis=1)


@triton.jit
def _fused_slot_kernel(
    x_ptr, w13_ptr, w2_ptr, weights_ptr, ids_ptr, sums_ptr, out_ptr, counter_ptr, num_tokens, top_k, hidden, inter,
    stride_x, stride_w13e, stride_w13n, stride_w2e, stride_w2n, stride_out,
    ACTIVATION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    UNROLL: tl.constexpr, BLOCK_OUT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Gate/up and down of one slot's ``BLOCK_N`` rows of I: ``h`` of those rows (rounded to
    x's dtype, as the two launches store it), then their columns of down times ``h``, weighted,
    added into the token's fp32 row of ``sums`` ``BLOCK_H`` rows of H at a time (down's first
    tile loads with gate/up's). The last program to finish casts the sums to ``out`` and
    zeroes them for the next call."""
    pdl_entry(PDL)
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    weight = tl.load(weights_ptr + slot).to(tl.float32)
    token = slot // top_k
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    down_cols = w2_ptr + expert * stride_w2e + rows[None, :]
    in_cols = rows[None, :] < inter
    hs = tl.arange(0, BLOCK_H)[:, None]
    down_w = tl.load(down_cols + hs.to(tl.int64) * stride_w2n, mask=(hs < hidden) & in_cols, other=0.0,
                     eviction_policy="evict_first")  # fmt: skip
    h = _gated_rows(x_ptr + token * stride_x, w13_ptr + expert * stride_w13e, rows, hidden, inter, stride_w13n,
                    ACTIVATION, BLOCK_K, UNROLL)  # fmt: skip
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32) * weight
    sums = sums_ptr + token * hidden
    for start in range(0, hidden, BLOCK_H):
        next_hs = start + BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        next_w = tl.load(down_cols + next_hs.to(tl.int64) * stride_w2n, mask=(next_hs < hidden) & in_cols, other=0.0,
                         eviction_policy="evict_first")  # fmt: skip
        part = tl.sum(down_w.to(tl.float32) * h[None, :], axis=1)
        at = start + tl.arange(0, BLOCK_H)
        tl.atomic_add(sums + at, part, mask=at < hidden, sem="relaxed")
        down_w = next_w
    if last_to_arrive(counter_ptr, tl.num_programs(0) * tl.num_programs(1)):
        for start in range(0, num_tokens * hidden, BLOCK_OUT):
            at = start + tl.arange(0, BLOCK_OUT)
            valid = at < num_tokens * hidden
            total = tl.load(sums_ptr + at, mask=valid, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + (at // hidden) * stride_out + at % hidden, total.to(out_ptr.dtype.element_ty),
                     mask=valid)  # fmt: skip
            tl.store(sums_ptr + at, tl.zeros_like(total), mask=valid)


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, weights_ptr, out_ptr, ids_ptr, top_k, hidden, inter, chunk,
    stride_h, stride_we, stride_wn, stride_out, stride_out_part,
    BLOCK_J: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UNROLL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A tile of a token's output rows, over one part of its slots and of I: part ``p`` is
    slots ``p // SPLIT * BLOCK_J`` on and the ``p % SPLIT``-th ``chunk`` columns, weighted
    and summed in fp32, the next step's weights loading while this step's are multiplied.

    The routing and the weights are read before the wait for gate/up (``pdl_entry``): only
    gate/up's output ``h`` is new, and the routing came before gate/up, whose programs had
    all waited for it before this kernel could start (launch.py)."""
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(2)
    j = (part // SPLIT) * BLOCK_J + tl.arange(0, BLOCK_J)
    slots = token * top_k + j
    chosen = j < top_k
    experts = tl.load(ids_ptr + slots, mask=chosen, other=0).to(tl.int64)
    weights = tl.load(weights_ptr + slots, mask=chosen, other=0.0).to(tl.float32)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = (part % SPLIT) * chunk
    end = tl.minimum(start + chunk, inter)
    w = w2_ptr + experts[:, None, None] * stride_we + rows[None, :, None].to(tl.int64) * stride_wn
    h = h_ptr + slots[:, None, None] * stride_h + 0 * rows[None, :, None]  # in w's shape: its layout, no conversion
    w_rows = chosen[:, None, None] & (rows[None, :, None] < hidden)
    first = start + tl.arange(0, BLOCK_K)[None, None, :]
    w_tile = tl.load(w + first, mask=w_rows & (first < end), other=0.0, eviction_policy="evict_first")
    pdl_entry(PDL)
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in tl.range(start, end, BLOCK_K, loop_unroll_factor=UNROLL):
        ks = (k + tl.arange(0, BLOCK_K))[None, None, :]
        next_ks = ks + BLOCK_K
        next_w_tile = tl.load(w + next_ks, mask=w_rows & (next_ks < end), other=0.0, eviction_policy="evict_first")
        a = tl.load(h + ks, mask=w_rows & (ks < end), other=0.0).to(tl.float32)
        acc += a * w_tile
        w_tile = next_w_tile
    out = tl.sum(tl.sum(acc, axis=2) * weights[:, None], axis=0)
    out_row = out_ptr + token * stride_out + part * stride_out_part
    tl.store(out_row + rows, out.to(out_ptr.dtype.element_ty), mask=rows < hidden)


@triton.jit
def _sum_parts_kernel(
    parts_ptr, out_ptr, num_parts, hidden, stride_parts, stride_parts_part, stride_out,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A token's output rows: its down parts [num_parts, hidden] summed, in one fixed order."""
    pdl_entry(PDL)
    token = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)[:, None]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (p < num_parts) & (cols[None, :] < hidden)
    parts = tl.load(parts_ptr + token * stride_parts + p * stride_parts_part + cols[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_out + cols, tl.sum(parts, axis=0).to(out_ptr.dtype.element_ty),
             mask=cols < hidden)  # fmt: skip


@dataclass(frozen=True)
class SlotTiles:
    """Tiles of the per-slot path. gate/up: a program per (slot, ``up_n`` rows of I), ``up_k``
    columns of H a step. down: a program per (token, ``down_n`` rows of H, part), a part
    being ``down_j`` of the token's k slots (0: all) over one of ``down_split`` chunks of I,
    ``down_k`` columns a step; with more than one part per token the parts are fp32 partials
    that one more launch sums in a fixed order (deterministic, unlike atomics).
    ``pipelined``: the kernels that load a step's weights while the step before is
    multiplied, ``up_unroll`` and ``down_unroll`` steps' loads issued together, and whose
    down issues its first weight loads before waiting for gate/up (False: the first kernels,
    which ignore ``down_j``, ``down_split`` and the unrolling).
    ``fused``: gate/up and down in one launch, a program per (slot, ``up_n`` rows of I) that
    also multiplies its rows of ``h`` by their columns of down, ``down_n`` rows of H a step,
    and adds the products into an fp32 row per token with atomics (``T*k*I/up_n`` adds of H
    values); the last program to finish casts the rows to the output. One launch and its ramp
    and tail fewer, no [T*k, I] buffer; the order of the sum varies from run to run."""

    up_n: int
    up_k: int
    down_n: int
    down_k: int
    down_j: int = 0
    down_split: int = 1
    up_warps: int = 4
    down_warps: int = 4
    up_unroll: int = 1
    down_unroll: int = 1
    pipelined: bool = True
    fused: bool = False


def slot_tiles(num_tokens: int, top_k: int, x: Tensor) -> SlotTiles:
    """The per-slot tiles for a step of ``num_tokens`` tokens (the interpreter's: small)."""
    if not gpu_tiles(x):
        return SlotTiles(up_n=16, up_k=32, down_n=16, down_k=32)
    # 4.2 TB/s over ~1 µs of latency asks for ~4 MB in flight; down: about 256 programs where the batch allows, [k, 8,
    # 128] tiles (16 KB). The rest as `python benchmarks/moe_kernels.py` settled it on the H200 (2026-12-03; Qwen3-30B-
    # A3B's and GLM-4.5-Air's experts): at 1-2 tokens [16, 256] gate/up tiles and down's loads two steps deep (1 token:
    # 22.9 µs a layer, 77 % of the copy bandwidth, against 35.4 µs for the first kernels), at 3-4 tokens [32, 128]
    # gate/up tiles two steps deep
    down_n = min(64 // triton.next_power_of_2(top_k), max(8, triton.next_power_of_2(num_tokens * 2048 // 256)))
    if num_tokens <= 2:
        return SlotTiles(up_n=16, up_k=256, down_n=down_n, down_k=128, down_unroll=2)
    return SlotTiles(up_n=32, up_k=128, down_n=down_n, down_k=128, up_unroll=2)


def slot_candidates(num_tokens: int, top_k: int, x: Tensor) -> tuple[SlotTiles, ...]:
    """Tiles the start-up measurement (xinfer_cuda/moe_tiles.py) times against
    :func:`slot_tiles` at ``num_tokens`` tokens: gate/up and down tile shapes and load depths
    around the heuristic's (what benchmarks/moe_kernels.py found best on the H200 moves with
    the GPU and the expert shape), in two launches and in one (``fused``); none under the
    interpreter."""
    if not gpu_tiles(x):
        return ()
    base = slot_tiles(num_tokens, top_k, x)
    ups = [(16, 256, 1), (16, 256, 2), (32, 128, 2), (8, 512, 1)]  # (up_n, up_k, up_unroll)
    downs = [(base.down_n, 1), (base.down_n, 2), (base.down_n, 3), (max(4, base.down_n // 2), 2)]  # (down_n, unroll)
    two_launches = tuple(
        replace(base, up_n=up_n, up_k=up_k, up_unroll=up_unroll, down_n=down_n, down_unroll=down_unroll)
        for up_n, up_k, up_unroll in ups
        for down_n, down_unroll in downs
    )
    # one launch: down's columns of each program's rows of I, [rows of H, up_n] a step, the
    # deeper tiles on 8 warps (on 4 they spill: down's first tile is held through gate/up)
    fused = tuple(
        replace(base, up_n=up_n, up_k=up_k, up_unroll=up_unroll, up_warps=warps, down_n=rows_of_h, fused=True)
        for up_n, up_k, up_unroll, warps, rows_of_h in [
            (16, 256, 1, 4, 512), (8, 512, 1, 4, 512), (16, 256, 2, 8, 512), (32, 128, 2, 8, 256),
        ]
    )  # fmt: skip
    return two_launches + fused


def _per_slot(
    x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, topk_ids: Tensor, activation: str, tiles: SlotTiles
) -> Tensor:
    num_tokens, top_k = topk_ids.shape
    _, hidden, inter = w2.shape
    num_slots = num_tokens * top_k
    h = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    pdl = launch.pdl(x.device)
    if tiles.fused and _fused_slots(x, w13, w2, weights, topk_ids, activation, tiles, out):
        return out
    if not tiles.pipelined:
        _slot_gate_up_kernel[(num_slots, triton.cdiv(inter, tiles.up_n))](
            x, w13, h, topk_ids, top_k, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
            ACTIVATION=ACTIVATIONS[activation], BLOCK_N=tiles.up_n, BLOCK_K=tiles.up_k, num_warps=tiles.up_warps,
            **pdl,
        )  # fmt: skip
        _token_down_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_n))](
            h, w2, weights, out, topk_ids, top_k, hidden, inter, h.stride(0), w2.stride(0), w2.stride(1),
            out.stride(0), BLOCK_J=triton.next_power_of_2(top_k), BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k,
            num_warps=tiles.down_warps, **pdl,
        )  # fmt: skip
        return out
    _gate_up_kernel[(num_slots, triton.cdiv(inter, tiles.up_n))](
        x, w13, h, topk_ids, top_k, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        ACTIVATION=ACTIVATIONS[activation], BLOCK_N=tiles.up_n, BLOCK_K=tiles.up_k, UNROLL=tiles.up_unroll,
        num_warps=tiles.up_warps, **pdl,
    )  # fmt: skip
    block_j = triton.next_power_of_2(min(tiles.down_j or top_k, top_k))  # slots per part
    num_parts = triton.cdiv(top_k, block_j) * tiles.down_split
    chunk = triton.cdiv(triton.cdiv(inter, tiles.down_split), tiles.down_k) * tiles.down_k
    parts = out if num_parts == 1 else torch.empty(num_tokens, num_parts, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(num_tokens, triton.cdiv(hidden, tiles.down_n), num_parts)](
        h, w2, weights, parts, topk_ids, top_k, hidden, inter, chunk, h.stride(0), w2.stride(0), w2.stride(1),
        parts.stride(0), 0 if num_parts == 1 else parts.stride(1),
        BLOCK_J=block_j, SPLIT=tiles.down_split, BLOCK_N=tiles.down_n,
        BLOCK_K=tiles.down_k, UNROLL=tiles.down_unroll, num_warps=tiles.down_warps, **pdl,
    )  # fmt: skip
    if num_parts > 1:
        block_p = triton.next_power_of_2(num_parts)
        block_n = max(16, 4096 // block_p)
        _sum_parts_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
            parts, out, num_parts, hidden, parts.stride(0), parts.stride(1), out.stride(0),
            BLOCK_P=block_p, BLOCK_N=block_n, **pdl,
        )  # fmt: skip
    return out


def _fused_slots(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    weights: Tensor,
    topk_ids: Tensor,
    activation: str,
    tiles: SlotTiles,
    out: Tensor,
) -> bool:
    """The experts into ``out`` in one launch (``tiles.fused``); False inside a CUDA graph capture
    that has no sums or counter for it (the caller runs the two launches then)."""
    num_tokens, top_k = topk_ids.shape
    _, hidden, inter = w2.shape
    sums = arrivals.counters(x.device, "fused_moe_sums", max(num_tokens, MAX_SLOTS_PER_SLOT_PATH) * hidden,
                             torch.float32)  # fmt: skip
    counter = arrivals.counters(x.device, "fused_moe", 1)
    if sums is None or counter is None:
        return False
    _fused_slot_kernel[(num_tokens * top_k, triton.cdiv(inter, tiles.up_n))](
        x, w13, w2, weights, topk_ids, sums, out, counter, num_tokens, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), out.stride(0),
        ACTIVATION=ACTIVATIONS[activation], BLOCK_N=tiles.up_n, BLOCK_K=tiles.up_k, BLOCK_H=tiles.down_n,
        UNROLL=tiles.up_unroll, BLOCK_OUT=min(4096, triton.next_power_of_2(num_tokens * hidden)),
        num_warps=tiles.up_warps, **launch.pdl(x.device),
    )  # fmt: skip
    return True


def fused_moe(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    topk_weights: Tensor,
    topk_ids: Tensor,
    activation: str,
    tiles: SlotTiles | None = None,
    shared_experts: int = 0,
    linear: Linear = F.linear,
) -> Tensor:
    """:meth:`xinfer.ops.Ops.fused_moe` in two launches (and, for larger batches, the
    three that group the slots by expert and the output's zeroing and cast, and the dense
    GEMMs of the ``shared_experts`` by ``linear``). ``tiles`` takes the per-slot path with
    those tiles, whatever the batch (benchmarks/moe_kernels.py times the alternatives);
    there a shared expert is one more slot of each token's."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()  # (no copies where they are, as models hold them)
    weights, ids = topk_weights.contiguous(), topk_ids.contiguous()
    if tiles is None and num_tokens * top_k > MAX_SLOTS_PER_SLOT_PATH:
        return _grouped(x, w13, w2, weights, ids, activation, shared_experts, linear)
    return _per_slot(x, w13, w2, weights, ids, activation, tiles or slot_tiles(num_tokens, top_k, x))
