"""Sparse multi-head latent attention (DeepSeek V3.2) over a paged latent cache: the CUDA backend's kernel of
``sparse_mla_attention`` (:mod:`xinfer_deepseek.sparse_mla_ops` holds the reference).

Each query reads its own ``K`` selected rows, so prefill and decode are one kernel: one program per (query
token, head group) gathers its selection's rows through its sequence's page table, a tile of ``BLOCK_N``
at a time, and folds them into an online softmax (fp32 accumulators, base 2) for all the group's heads at
once (every head reads the same rows). The step's rows are stored first by :mod:`.mla`'s store kernel.
Grids depend only on shapes and the token-to-sequence map is computed on the device, so steps can be
captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import LOG2E, launch_chain
from xinfer.ops import AttentionMetadata
from xinfer_deepseek.kernels.mla import DOT_MIN, NEG_BIG, _load_rows, _store_kernel


@triton.jit
def _sparse_kernel(q_latent_ptr, q_rope_ptr, cache_ptr, out_ptr, selected_ptr, seq_of_token_ptr, block_table_ptr,
                   num_seqs, num_heads, num_selected, score_scale, stride_ql_t, stride_ql_h, stride_qr_t, stride_qr_h,
                   stride_o_t, stride_o_h, stride_sel, stride_table, BLOCK_SIZE: tl.constexpr, WIDTH: tl.constexpr,
                   R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, ENTER: tl.constexpr):  # fmt: skip
    ENTER()
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    seq = tl.load(seq_of_token_ptr + tok)
    if seq >= num_seqs:  # padding: no sequence
        return
    q_latent = _load_rows(q_latent_ptr, tok * stride_ql_t + heads * stride_ql_h, head_ok, R, BLOCK_R)
    q_rope = _load_rows(q_rope_ptr, tok * stride_qr_t + heads * stride_qr_h, head_ok, P, BLOCK_P)

    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    table = block_table_ptr + seq * stride_table
    for tile_start in range(0, num_selected, BLOCK_N):
        k = tile_start + tl.arange(0, BLOCK_N)
        pos = tl.load(selected_ptr + tok * stride_sel + k, mask=k < num_selected, other=-1)
        chosen = pos >= 0
        pos = tl.where(chosen, pos, 0)
        block = tl.load(table + pos // BLOCK_SIZE, mask=chosen, other=0).to(tl.int64)
        row = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * WIDTH
        latent = _load_rows(cache_ptr, row, chosen, R, BLOCK_R).to(q_latent.dtype)
        rope = _load_rows(cache_ptr + R, row, chosen, P, BLOCK_P).to(q_rope.dtype)
        s = tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(rope), s, input_precision=PRECISION) * score_scale
        s = tl.where(chosen[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        weights = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(weights, 1)
        acc = tl.dot(weights.to(latent.dtype), latent, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    cols = tl.arange(0, BLOCK_R)
    at = out_ptr + tok * stride_o_t + heads[:, None] * stride_o_h + cols[None, :]
    tl.store(at, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (cols < R)[None, :])


def sparse_mla_attention(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    selected: Tensor,
    block_h: int = 16,
    block_n: int = 32,
) -> Tensor:
    """:func:`xinfer_deepseek.sparse_mla_ops.sparse_mla_attention` in Triton; ``block_h`` heads and ``block_n``
    selected rows per tile (overrides for tests and tuning). Rows of no sequence are zero."""
    num_tokens, num_heads, rank = q_latent.shape
    _, block_size, width = cache.shape
    rope_dim = q_rope.shape[-1]
    assert cache.is_contiguous() and latent.shape[-1] == width, (latent.shape, cache.shape)
    q_latent, q_rope, latent, selected = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (q_latent, q_rope, latent, selected)
    )
    out = torch.zeros(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    launch = launch_chain(q_latent.device)
    _store_kernel[(num_tokens,)](latent, cache, meta.slot_mapping, latent.stride(0), WIDTH=width,
                                 BLOCK_W=triton.next_power_of_2(width), **launch)  # fmt: skip
    tokens = torch.arange(num_tokens, device=q_latent.device, dtype=meta.cu_seqlens_q.dtype)
    seq_of_token = torch.searchsorted(meta.cu_seqlens_q[1:], tokens, right=True)  # num_seqs: past every sequence
    block_h = max(DOT_MIN, min(block_h, triton.next_power_of_2(num_heads)))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _sparse_kernel[grid](
        q_latent, q_rope, cache, out, selected, seq_of_token, meta.block_tables, meta.num_seqs, num_heads,
        selected.shape[1], scale * LOG2E, *q_latent.stride()[:2], *q_rope.stride()[:2], *out.stride()[:2],
        selected.stride(0), meta.block_tables.stride(0), BLOCK_SIZE=block_size, WIDTH=width, R=rank, P=rope_dim,
        BLOCK_R=max(DOT_MIN, triton.next_power_of_2(rank)), BLOCK_P=max(DOT_MIN, triton.next_power_of_2(rope_dim)),
        BLOCK_H=block_h, BLOCK_N=block_n, PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", **launch,
    )  # fmt: skip
    return out
