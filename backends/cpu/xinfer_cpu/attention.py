"""Attention of a decode step (one query per sequence) for every sequence at once: each sequence's
context gathered from its blocks into one padded batch [B, L, Hkv, D], the positions past its
length (and before its window) masked, and one ``scaled_dot_product_attention`` over it, where the
reference (:meth:`xinfer.torch_ops.TorchOps.attend`) runs some twenty ops per sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from xinfer.forward_context import once_per_step
from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata


def is_decode(q: Tensor, meta: AttentionMetadata) -> bool:
    """Each sequence of the step has exactly one query, and attends to its cache alone."""
    return meta.max_seqlen_q == 1 and q.shape[0] == meta.num_seqs and meta.shadows is None and meta.key_limits is None


def decode_attention(
    q: Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None = None
) -> Tensor:
    """q [B, H, D], sequence ``b``'s query at position ``seq_lens[b] - 1``, attending to the keys
    at positions ``seq_lens[b] - window`` (0 without a window) to ``seq_lens[b] - 1``."""
    num_seqs, num_heads, head_dim = q.shape
    context = meta.max_seq_len
    blocks = once_per_step(
        f"cpu.decode_blocks.{cache.block_size}.{context}",
        (meta.block_tables,),
        # a window's layers drop the blocks before it (-1): any block stands in, its positions are masked
        lambda: meta.block_tables[:, : -(-context // cache.block_size)].flatten().clamp(min=0),
    )
    stored = {  # [B, L, Hkv, ...]
        name: t.index_select(0, blocks).view(num_seqs, -1, *t.shape[2:])[:, :context]
        for name, t in cache.tensors.items()
    }
    k, v = cache.format.decode(stored)
    query = cache.format.prepare_query(q, cache.equalizer).float()
    # the query heads of a KV head are its queries: [B, Hkv, group, D] against [B, Hkv, L, D]
    query = query.view(num_seqs, cache.num_kv_heads, -1, head_dim)
    visible = once_per_step(
        f"cpu.decode_mask.{window}.{context}", (meta.seq_lens,), lambda: _visible(meta.seq_lens, context, window)
    )
    out = F.scaled_dot_product_attention(query, k.transpose(1, 2), v.transpose(1, 2), visible, scale=scale)
    return cache.format.finish_output(out.reshape(num_seqs, num_heads, -1)).to(q.dtype)


def _visible(seq_lens: Tensor, context: int, window: int | None) -> Tensor:
    """[B, 1, 1, L]: key position ``j`` is visible to sequence ``b``'s query."""
    positions = torch.arange(context, device=seq_lens.device)
    lengths = seq_lens[:, None].long()
    visible = positions < lengths
    if window is not None:
        visible &= positions >= lengths - window
    return visible[:, None, None, :]
