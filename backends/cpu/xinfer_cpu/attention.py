"""Attention of a decode step (one query per sequence): the blocks of every sequence gathered (and
decoded) at once, a layer, then one ``scaled_dot_product_attention`` per sequence over its span of
them ([1, Hkv, L, D]), where the reference (:meth:`xinfer.torch_ops.TorchOps.attend`) runs some
twenty ops per sequence. One call per
sequence, at its own length, is what keeps its tokens independent of the rest of the batch: a
batch padded to the longest context, or sequences of one length together, change how the CPU
kernel splits its reductions."""

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
    # the query heads of a KV head are its queries: [1, Hkv, group, D] against [1, Hkv, L, D]
    query = query.view(num_seqs, cache.num_kv_heads, -1, head_dim)
    blocks, spans = once_per_step(
        f"cpu.decode_blocks.{cache.block_size}",
        (meta.seq_lens, meta.block_tables),
        lambda: _contexts(meta.seq_lens, meta.block_tables, cache.block_size),
    )
    # every sequence's blocks in one gather (one decode of them); a sequence's keys are a span of it
    k, v = cache.format.decode(
        {name: t.index_select(0, blocks).flatten(0, 1)[None] for name, t in cache.tensors.items()}
    )
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [1, Hkv, positions, D]
    outputs = []
    for row, (start, end) in enumerate(spans):
        if window is not None:  # (blocks before a window are -1: read as block 0, not attended)
            start = max(start, end - window)
        keys, values = k.narrow(2, start, end - start), v.narrow(2, start, end - start)
        outputs.append(F.scaled_dot_product_attention(query[row : row + 1], keys, values, scale=scale))
    out = torch.cat(outputs) if num_seqs > 1 else outputs[0]
    return cache.format.finish_output(out.view(num_seqs, num_heads, -1)).to(q.dtype)


def _contexts(seq_lens: Tensor, block_tables: Tensor, block_size: int) -> tuple[Tensor, list[tuple[int, int]]]:
    """The blocks of every sequence one after another (a dropped block, -1, read as block 0), and
    each sequence's span (start, end) of positions in them."""
    blocks: list[int] = []
    spans = []
    for table, length in zip(block_tables.tolist(), seq_lens.tolist()):
        start = len(blocks) * block_size
        blocks += table[: -(-length // block_size)]
        spans.append((start, start + length))
    return torch.tensor(blocks).clamp_(min=0), spans
