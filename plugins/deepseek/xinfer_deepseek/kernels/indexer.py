"""DeepSeek V3.2's lightning indexer over a paged cache of its keys: the CUDA backend's kernel of
``indexer_topk`` (:mod:`xinfer_deepseek.indexer_ops` holds the reference).

The step's keys are stored by :mod:`.mla`'s store kernel; ``_score_kernel`` writes each query's index
score at every position its sequence's page table can hold (one program per query token and tile of
``BLOCK_N`` positions: the tile's keys gathered through the page table, one dot for all the indexer's
heads, ReLU, the heads summed by the query's weights; -inf past the query's position); ``torch.topk``
then selects. Every shape comes from tensor shapes, so steps can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import launch_chain
from xinfer.ops import AttentionMetadata
from xinfer_deepseek.kernels.mla import DOT_MIN, _load_rows, _store_kernel


@triton.jit
def _score_kernel(q_ptr, weights_ptr, cache_ptr, scores_ptr, cu_seqlens_q_ptr, seq_lens_ptr, seq_of_token_ptr,
                  block_table_ptr, num_seqs, num_heads, width, scale, stride_q_t, stride_q_h, stride_w_t,
                  stride_s_t, stride_table, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, ENTER: tl.constexpr):  # fmt: skip
    ENTER()
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq = tl.load(seq_of_token_ptr + tok)
    q_pos = tl.full((), -1, tl.int64)  # padding: no sequence, sees nothing (int64, as the sum below: tok is)
    if seq < num_seqs:
        q_pos = tl.load(seq_lens_ptr + seq) - tl.load(cu_seqlens_q_ptr + seq + 1) + tok
    visible = pos <= q_pos
    heads = tl.arange(0, BLOCK_H)
    q = _load_rows(q_ptr, tok * stride_q_t + heads * stride_q_h, heads < num_heads, D, BLOCK_D)
    w = tl.load(weights_ptr + tok * stride_w_t + heads, mask=heads < num_heads, other=0.0).to(tl.float32)
    block = tl.load(block_table_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
    keys = _load_rows(cache_ptr, (block * BLOCK_SIZE + pos % BLOCK_SIZE) * D, visible, D, BLOCK_D).to(q.dtype)
    s = tl.maximum(tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale, 0.0)  # [H, N]
    index = tl.sum(w[:, None] * s, 0)
    tl.store(scores_ptr + tok * stride_s_t + pos, tl.where(visible, index, float("-inf")), mask=pos < width)


def indexer_topk(
    q: Tensor,
    key: Tensor,
    weights: Tensor,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    topk: int,
    block_n: int = 64,
) -> Tensor:
    """:func:`xinfer_deepseek.indexer_ops.indexer_topk` in Triton and ``torch.topk``; ``block_n`` positions
    per program (an override for tests and tuning)."""
    num_tokens, num_heads, dim = q.shape
    _, block_size, _ = cache.shape
    assert cache.is_contiguous() and key.shape[-1] == dim == cache.shape[-1], (key.shape, cache.shape)
    q, key, weights = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, key, weights))
    selected = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=q.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return selected
    launch = launch_chain(q.device)
    _store_kernel[(num_tokens,)](key, cache, meta.slot_mapping, key.stride(0), WIDTH=dim,
                                 BLOCK_W=triton.next_power_of_2(dim), **launch)  # fmt: skip
    width = meta.block_tables.shape[1] * block_size  # every position a page table holds
    scores = torch.empty(num_tokens, width, dtype=torch.float32, device=q.device)
    tokens = torch.arange(num_tokens, device=q.device, dtype=meta.cu_seqlens_q.dtype)
    seq_of_token = torch.searchsorted(meta.cu_seqlens_q[1:], tokens, right=True)  # num_seqs: past every sequence
    _score_kernel[(num_tokens, triton.cdiv(width, block_n))](
        q, weights, cache, scores, meta.cu_seqlens_q, meta.seq_lens, seq_of_token, meta.block_tables, meta.num_seqs,
        num_heads, width, scale, *q.stride()[:2], weights.stride(0), scores.stride(0), meta.block_tables.stride(0),
        BLOCK_SIZE=block_size, D=dim, BLOCK_D=max(DOT_MIN, triton.next_power_of_2(dim)),
        BLOCK_H=max(DOT_MIN, triton.next_power_of_2(num_heads)), BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **launch,
    )  # fmt: skip
    best, positions = scores.topk(min(topk, width), dim=-1)
    selected[:, : positions.shape[1]] = positions.masked_fill(best == float("-inf"), -1).int()
    return selected
