"""Sparse multi-head latent attention (DeepSeek V3.2): :func:`xinfer_deepseek.mla_ops.mla_attention`
restricted to the positions each query's indexer selected, the op's plain-torch reference."""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.ops import AttentionMetadata
from xinfer_deepseek.mla_ops import store


def sparse_mla_attention(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    selected: Tensor,
) -> Tensor:
    """Store this step's ``latent`` [T, R + P] in ``cache`` [num_blocks, block_size, R + P] at
    ``meta.slot_mapping`` (negative: skipped), then attention of each query over the cached rows at
    its ``selected`` [T, K] positions of its sequence (-1: none; the selection is causal)::

        s[t, h, k] = scale * (q_latent[t, h] . row[:R] + q_rope[t, h] . row[R:]),  row = the row at selected[t, k]
        out[t, h] = sum_k softmax_k(s[t, h]) * row[:R]

    in fp32. Returns [T, H, R] in the dtype of ``q_latent``; rows of no sequence are zero."""
    store(cache, latent.to(cache.dtype), meta.slot_mapping)
    rank, block_size = q_latent.shape[-1], cache.shape[1]
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q_latent.device)
    num_tokens = int(meta.cu_seqlens_q[-1])
    seq_of_token = torch.repeat_interleave(
        torch.arange(meta.num_seqs, device=q_latent.device), meta.cu_seqlens_q.diff().long()
    )
    positions = selected[:num_tokens].long()
    chosen = positions >= 0
    positions = positions.clamp(min=0)
    blocks = meta.block_tables[seq_of_token].long().gather(1, positions // block_size)
    rows = cache.view(-1, cache.shape[-1])[blocks * block_size + positions % block_size].float()  # [T, K, R + P]
    q = torch.cat([q_latent, q_rope], dim=-1)[:num_tokens].float()
    scores = scale * torch.einsum("thd,tkd->thk", q, rows)
    probs = scores.masked_fill(~chosen[:, None, :], float("-inf")).softmax(dim=-1)
    out[:num_tokens] = torch.einsum("thk,tkr->thr", probs, rows[..., :rank])
    return out.to(q_latent.dtype)
