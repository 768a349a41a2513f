"""The causal depthwise conv1d of a Gated DeltaNet layer, for prefill and decode alike
(:func:`xinfer_qwen.deltanet_ops.causal_conv1d` is its reference).

One program per (sequence, channel tile, tile of its rows): each row sums K taps of the
sequence's input stream, whose values before this step come from the conv state. The
program of a sequence's first row tile is the only one that reads or writes its state:
rows of later tiles reach back at most K-1 <= BLOCK_T rows, all of them in this step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.ops import AttentionMetadata
from xinfer_cuda.kernel_api import pdl, pdl_entry

ACTIVATIONS = (None, "silu", "swish")
MAX_BLOCK_T = 32
BLOCK_C = 128


@triton.jit
def _stream(x_ptr, state_ptr, lo, q_len, src, channels, stride_x, stride_state_c, stride_state_k, continues,
            WIDTH: tl.constexpr):  # fmt: skip
    """The sequence's input stream at step-relative rows ``src`` [R] and ``channels`` [C]:
    this step's ``x`` from row 0 on, the state before it (zeros unless the sequence continues)."""
    in_step = (src >= 0) & (src < q_len)
    from_x = tl.load(x_ptr + (lo + src)[:, None].to(tl.int64) * stride_x + channels[None, :],
                     mask=in_step[:, None], other=0.0)  # fmt: skip
    in_state = (src < 0) & (src >= tl.where(continues, 1 - WIDTH, 0))  # (a scalar bool in a mask trips the interpreter)
    from_state = tl.load(state_ptr + channels[None, :] * stride_state_c + (WIDTH - 1 + src)[:, None] * stride_state_k,
                         mask=in_state[:, None], other=0.0)  # fmt: skip
    return from_x.to(tl.float32) + from_state.to(tl.float32)


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, out_ptr, cu_seqlens_ptr, seq_lens_ptr, slots_ptr,
    stride_x, stride_out, stride_state_slot, stride_state_c, stride_state_k, num_channels,
    WIDTH: tl.constexpr, WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    seq, row_tile = tl.program_id(0), tl.program_id(2)
    lo = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - lo
    if row_tile * BLOCK_T >= q_len:
        return
    continues = tl.load(seq_lens_ptr + seq) != q_len
    state_ptr += tl.load(slots_ptr + seq).to(tl.int64) * stride_state_slot
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_bounds = channels < num_channels
    channels = tl.where(in_bounds, channels, 0)  # loads stay in bounds; the stores mask these
    rows = row_tile * BLOCK_T + tl.arange(0, BLOCK_T)

    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + channels).to(tl.float32)[None, :]
    for i in tl.static_range(WIDTH):
        u = _stream(x_ptr, state_ptr, lo, q_len, rows - (WIDTH - 1) + i, channels, stride_x, stride_state_c,
                    stride_state_k, continues, WIDTH)  # fmt: skip
        acc += tl.load(weight_ptr + channels * WIDTH + i).to(tl.float32)[None, :] * u
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (lo + rows)[:, None].to(tl.int64) * stride_out + channels[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None] & in_bounds[None, :])  # fmt: skip

    if row_tile == 0:  # the state becomes the stream's last K-1 values
        window = tl.arange(0, WINDOW)
        last = _stream(x_ptr, state_ptr, lo, q_len, q_len - (WIDTH - 1) + window, channels, stride_x, stride_state_c,
                       stride_state_k, continues, WIDTH)  # fmt: skip
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
    grid = (meta.num_seqs, triton.cdiv(channels, BLOCK_C), triton.cdiv(meta.max_seqlen_q, block_t))
    _causal_conv1d_kernel[grid](
        x, weight.contiguous(), x if bias is None else bias, state, out, meta.cu_seqlens_q, meta.seq_lens, slots,
        x.stride(0), out.stride(0), *state.stride(), channels,
        WIDTH=width, WINDOW=triton.next_power_of_2(max(width - 1, 1)), HAS_BIAS=bias is not None,
        SILU=activation is not None, BLOCK_T=block_t, BLOCK_C=BLOCK_C, num_warps=4, **pdl(x.device),
    )  # fmt: skip
    return out
