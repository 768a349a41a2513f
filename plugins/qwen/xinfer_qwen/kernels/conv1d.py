"""The causal depthwise conv1d of a Gated DeltaNet layer, for prefill and decode alike
(:func:`xinfer_qwen.deltanet_ops.causal_conv1d` is its reference).

One program per (channel tile, row tile of one sequence): the step's rows are cut into tiles
per sequence (a sequence of q rows has ceil(q / BLOCK_T) of them) and numbered in order, so
a batch mixing a long prompt with many decode rows launches about T / BLOCK_T + num_seqs
programs, not num_seqs x max_q_len / BLOCK_T. Each program loads the tile's rows once per tap
(the K shifted loads of one [BLOCK_T, BLOCK_C] tile overlap, so all but the first hit the
cache): contiguous, vectorized rows of channels, which is what makes the kernel
bandwidth-bound.

A sequence's first tile is the only one that reads or writes its conv state: rows of later
tiles reach back at most K-1 <= BLOCK_T rows, all of them in this step. Its first K-1 rows,
the ones that reach into the state, are computed apart in a small tile of their own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import launch_chain
from xinfer.ops import AttentionMetadata

ACTIVATIONS = (None, "silu", "swish")
MAX_BLOCK_T = 16  # 64 registers a thread at 8 warps (Triton 3.6, sm_90): 4 programs an SM; 32 rows take 127
BLOCK_C = 256
SEARCH = 128  # sequences the tile search reads at a time


@triton.jit
def _find_tile(cu_seqlens_ptr, num_seqs, tile, BLOCK_T: tl.constexpr, SEARCH: tl.constexpr):
    """(sequence, its tile number) of the ``tile``-th row tile of the step; the sequence is
    ``num_seqs`` when ``tile`` is past the last."""
    seq = 0
    tiles_before = 0  # of the sequences already searched
    first_tile = 0  # the found sequence's first tile
    for base in range(0, num_seqs, SEARCH):
        b = base + tl.arange(0, SEARCH)
        in_batch = b < num_seqs
        q_lens = tl.load(cu_seqlens_ptr + b + 1, mask=in_batch, other=0) - tl.load(cu_seqlens_ptr + b, mask=in_batch, other=0)  # fmt: skip
        tiles = tl.cdiv(q_lens, BLOCK_T)
        ends = tiles_before + tl.cumsum(tiles, axis=0)  # one past each sequence's last tile
        done = (ends <= tile) & in_batch
        seq += tl.sum(done.to(tl.int32), axis=0)
        first_tile += tl.sum(tl.where(done, tiles, 0), axis=0)
        tiles_before += tl.sum(tiles, axis=0)
    return seq, tile - first_tile


@triton.jit
def _x_rows(x_ptr, lo, q_len, src, channels, stride_x, in_bounds):
    """This step's ``x`` at the sequence's rows ``src`` [R] (zeros outside ``0 <= src < q_len``)."""
    in_step = (src >= 0) & (src < q_len)
    ptrs = x_ptr + (lo + src).to(tl.int64)[:, None] * stride_x + channels[None, :]
    return tl.load(ptrs, mask=in_step[:, None] & in_bounds[None, :], other=0.0).to(tl.float32)


@triton.jit
def _state_rows(state_ptr, src, channels, stride_state_c, stride_state_k, in_bounds, continues, WIDTH: tl.constexpr):
    """The sequence's stream before this step at rows ``src`` [R] < 0: its conv state, zeros
    unless it continues (and at rows >= 0)."""
    in_state = (src < 0) & (src >= tl.where(continues, 1 - WIDTH, 0))  # (a scalar bool in a mask trips the interpreter)
    ptrs = state_ptr + channels[None, :] * stride_state_c + (WIDTH - 1 + src)[:, None] * stride_state_k
    return tl.load(ptrs, mask=in_state[:, None] & in_bounds[None, :], other=0.0).to(tl.float32)


@triton.jit
def _conv_rows(x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, lo, q_len, rows, channels, in_bounds, stride_x,
               stride_out, stride_state_c, stride_state_k, continues, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
               SILU: tl.constexpr, FROM_STATE: tl.constexpr):  # fmt: skip
    """Writes the output at the sequence's ``rows`` [R] (those in ``0 <= rows < q_len``); the
    stream before this step, from the state, only ``FROM_STATE`` (rows reaching back before 0)."""
    acc = tl.zeros([rows.shape[0], channels.shape[0]], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels, mask=in_bounds, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(WIDTH):
        src = rows - (WIDTH - 1) + i
        u = _x_rows(x_ptr, lo, q_len, src, channels, stride_x, in_bounds)
        if FROM_STATE:
            u += _state_rows(state_ptr, src, channels, stride_state_c, stride_state_k, in_bounds, continues, WIDTH)
        acc += tl.load(weight_ptr + channels * WIDTH + i, mask=in_bounds, other=0.0).to(tl.float32)[None, :] * u
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (lo + rows).to(tl.int64)[:, None] * stride_out + channels[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=((rows >= 0) & (rows < q_len))[:, None] & in_bounds[None, :])  # fmt: skip


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, cu_seqlens_ptr, seq_lens_ptr, slots_ptr,
    stride_x, stride_out, stride_state_slot, stride_state_c, stride_state_k, num_channels, num_seqs,
    WIDTH: tl.constexpr, WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH: tl.constexpr, ENTER: tl.constexpr,
):  # fmt: skip
    ENTER()
    seq, row_tile = _find_tile(cu_seqlens_ptr, num_seqs, tl.program_id(1), BLOCK_T, SEARCH)
    if seq >= num_seqs:
        return
    lo = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - lo
    channels = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_bounds = channels < num_channels
    rows = row_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    # the bulk of the rows from this step's x alone: the first tile leaves its first K-1 rows, which
    # reach into the state, to a small tile of their own (the state's loads, contiguous along the
    # taps, get a layout of their own: mixed into the whole tile they cost it a trip through
    # shared memory and twice the registers, as Triton 3.6 compiles it)
    rows = tl.where(rows < tl.where(row_tile == 0, WIDTH - 1, 0), -1, rows)
    _conv_rows(x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, lo, q_len, rows, channels, in_bounds, stride_x,
               stride_out, stride_state_c, stride_state_k, False, WIDTH, HAS_BIAS, SILU, False)  # fmt: skip

    if row_tile == 0:  # the rows reaching into the state; then the state becomes the stream's last K-1 values
        continues = tl.load(seq_lens_ptr + seq) != q_len
        state_ptr += tl.load(slots_ptr + seq).to(tl.int64) * stride_state_slot
        window = tl.arange(0, WINDOW)
        first = tl.where(window < WIDTH - 1, window, -1)
        _conv_rows(x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, lo, q_len, first, channels, in_bounds, stride_x,
                   stride_out, stride_state_c, stride_state_k, continues, WIDTH, HAS_BIAS, SILU, True)  # fmt: skip
        last_rows = q_len - (WIDTH - 1) + window
        last = _x_rows(x_ptr, lo, q_len, last_rows, channels, stride_x, in_bounds)
        last += _state_rows(state_ptr, last_rows, channels, stride_state_c, stride_state_k, in_bounds, continues, WIDTH)
        tl.debug_barrier()  # every read of the old state (by any thread) before it is overwritten
        tl.store(state_ptr + channels[None, :] * stride_state_c + window[:, None] * stride_state_k,
                 last.to(state_ptr.dtype.element_ty), mask=(window < WIDTH - 1)[:, None] & in_bounds[None, :])  # fmt: skip


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state: Tensor,
    meta: AttentionMetadata,
    slots: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """See :func:`xinfer_qwen.deltanet_ops.causal_conv1d`."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: unknown activation {activation!r}; known: {', '.join(map(str, ACTIVATIONS))}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    channels, width = weight.shape
    out = torch.empty_like(x)  # rows of no sequence (a padded step's) are left unwritten
    if x.shape[0] == 0 or meta.num_seqs == 0:
        return out
    assert state.shape[1:] == (channels, width - 1)
    block_t = triton.next_power_of_2(max(min(meta.max_seqlen_q, MAX_BLOCK_T), width - 1))  # >= K-1: see the top
    # every sequence's tiles fit in T / BLOCK_T + num_seqs, a bound known without reading the lengths
    grid = (triton.cdiv(channels, BLOCK_C), triton.cdiv(x.shape[0], block_t) + meta.num_seqs)
    num_warps = 8 if block_t >= 16 else 4
    _causal_conv1d_kernel[grid](
        x, weight.contiguous(), x if bias is None else bias, state, out, meta.cu_seqlens_q, meta.seq_lens, slots,
        x.stride(0), out.stride(0), *state.stride(), channels, meta.num_seqs,
        WIDTH=width, WINDOW=triton.next_power_of_2(max(width - 1, 1)), HAS_BIAS=bias is not None,
        SILU=activation is not None, BLOCK_T=block_t, BLOCK_C=BLOCK_C, SEARCH=SEARCH, num_warps=num_warps, **launch_chain(x.device),
    )  # fmt: skip
    return out
