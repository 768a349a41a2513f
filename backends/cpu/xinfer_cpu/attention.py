"""Attention of a decode step (one query per sequence): the sequences of one context length in
one ``scaled_dot_product_attention`` over their contexts gathered from the blocks ([n, L, Hkv, D]),
where the reference (:meth:`xinfer.torch_ops.TorchOps.attend`) runs some twenty ops per sequence.
Grouping by length, not padding to the longest, keeps every sequence's reductions the length of its
own context, so its tokens do not depend on what else is in the batch."""

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
    query = cache.format.prepare_query(q, cache.equalizer).float()
    # the query heads of a KV head are its queries: [B, Hkv, group, D] against [B, Hkv, L, D]
    query = query.view(num_seqs, cache.num_kv_heads, -1, head_dim)
    groups = once_per_step(
        f"cpu.decode_groups.{cache.block_size}",
        (meta.seq_lens, meta.block_tables),
        lambda: _length_groups(meta.seq_lens, meta.block_tables, cache.block_size),
    )
    parts, order = [], []
    for length, rows, blocks in groups:
        first = max(0, length - window) if window is not None else 0  # (blocks before a window are -1: unread)
        stored = {  # [n, L, Hkv, ...]
            name: t.index_select(0, blocks).view(len(rows), -1, *t.shape[2:])[:, first:length]
            for name, t in cache.tensors.items()
        }
        k, v = cache.format.decode(stored)
        parts.append(F.scaled_dot_product_attention(query[rows], k.transpose(1, 2), v.transpose(1, 2), scale=scale))
        order.append(rows)
    out = torch.cat(parts)[torch.cat(order).argsort()] if len(parts) > 1 else parts[0]
    return cache.format.finish_output(out.reshape(num_seqs, num_heads, -1)).to(q.dtype)


def _length_groups(seq_lens: Tensor, block_tables: Tensor, block_size: int) -> list[tuple[int, Tensor, Tensor]]:
    """(length, the rows of that context length, their blocks flattened, a dropped block (-1) read as block 0)."""
    rows_of: dict[int, list[int]] = {}
    for row, length in enumerate(seq_lens.tolist()):
        rows_of.setdefault(length, []).append(row)
    groups = []
    for length, rows in rows_of.items():
        index = torch.tensor(rows)
        blocks = block_tables[index, : -(-length // block_size)].flatten().clamp(min=0)
        groups.append((length, index, blocks))
    return groups
