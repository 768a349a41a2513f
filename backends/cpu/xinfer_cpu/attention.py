"""Attention of a decode step (one query per sequence), where the reference
(:meth:`xinfer.torch_ops.TorchOps.attend`) runs some twenty ops per sequence.

The blocks of every sequence are gathered (and decoded) at once, a layer: a view of the cache
when they are consecutive (a lone sequence's usually are), one ``index_select`` otherwise. The
sequences of one context length then attend as one batch, ``softmax(q k^T * scale) v`` by
batched matmuls, each sequence's slice its own matmul at its own length. That keeps a sequence's
output bit for bit what it is alone, whatever else is in the step: a batch padded to the longest
context changes how the reductions over its positions are split, and so does torch's fused CPU
attention, which splits one sequence's positions across threads but not a batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer.forward_context import once_per_step
from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata


def is_decode(q: Tensor, meta: AttentionMetadata) -> bool:
    """Each sequence of the step has exactly one query, and attends to its cache alone."""
    return meta.max_seqlen_q == 1 and q.shape[0] == meta.num_seqs and meta.shadows is None and meta.key_limits is None


@dataclass(frozen=True)
class LengthGroup:
    """The step's sequences of one context ``length``: their ``rows`` (a range of rows, or their
    indices), and where their contexts sit in the gathered positions: ``count`` spans of ``width``
    positions from ``start``, one per sequence, each padded to whole blocks."""

    rows: slice | Tensor
    length: int
    start: int
    count: int
    width: int


@dataclass(frozen=True)
class DecodeContexts:
    blocks: slice | Tensor  # the cache's blocks to gather, group after group (a slice when consecutive)
    groups: list[LengthGroup]
    order: Tensor | None  # the rows in group order, where that is not the batch's


def decode_attention(
    q: Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window: int | None = None
) -> Tensor:
    """q [B, H, D], sequence ``b``'s query at position ``seq_lens[b] - 1``, attending to the keys
    at positions ``seq_lens[b] - window`` (0 without a window) to ``seq_lens[b] - 1``."""
    num_seqs, num_heads, head_dim = q.shape
    query = cache.format.prepare_query(q, cache.equalizer).float()
    # the query heads of a KV head are its queries: [B, Hkv, group, D] against [B, Hkv, L, D]
    query = query.view(num_seqs, cache.num_kv_heads, -1, head_dim)
    contexts = once_per_step(
        f"cpu.decode_contexts.{cache.block_size}",
        (meta.seq_lens, meta.block_tables),
        lambda: _contexts(meta.seq_lens, meta.block_tables, cache.block_size),
    )
    k, v = cache.format.decode({name: _gather(t, contexts.blocks).flatten(0, 1) for name, t in cache.tensors.items()})
    outputs = []
    for group in contexts.groups:
        start = 0 if window is None else max(0, group.length - window)  # (dropped blocks, -1, read as block 0)
        keys, values = _matrices(k, group, start), _matrices(v, group, start)  # [G * Hkv, L, D]
        queries = query[group.rows].flatten(0, 1)  # [G * Hkv, group, D]
        scores = torch.bmm(queries, keys.transpose(1, 2)).mul_(scale)
        outputs.append(torch.bmm(torch.softmax(scores, dim=-1), values).unflatten(0, (group.count, -1)))
    out = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    if contexts.order is not None:
        out = torch.empty_like(out).index_copy_(0, contexts.order, out)
    return cache.format.finish_output(out.view(num_seqs, num_heads, -1)).to(q.dtype)


def _matrices(x: Tensor, group: LengthGroup, start: int) -> Tensor:
    """Positions ``start`` to ``group.length - 1`` of each of the group's contexts in ``x`` [P, Hkv, D], as
    [G * Hkv, L, D], as bmm reads a batch's matrices alike whatever the batch's size: contiguous (a
    batch of strided matrices takes another path, giving other bits than each alone); one context's as
    the view it is (a chain of view ops costs a call each, every layer)."""
    position, head, dim = x.stride()
    offset = x.storage_offset() + (group.start + start) * position
    length, heads = group.length - start, x.shape[1]
    if group.count == 1:
        return x.as_strided((heads, length, x.shape[2]), (head, position, dim), offset)
    spans = x.as_strided(
        (group.count, heads, length, x.shape[2]), (group.width * position, head, position, dim), offset
    )
    return spans.contiguous().flatten(0, 1)


def _gather(blocks_of: Tensor, blocks: slice | Tensor) -> Tensor:
    return blocks_of[blocks] if isinstance(blocks, slice) else blocks_of.index_select(0, blocks)


def _contexts(seq_lens: Tensor, block_tables: Tensor, block_size: int) -> DecodeContexts:
    by_length: dict[int, list[int]] = {}
    for row, length in enumerate(seq_lens.tolist()):
        by_length.setdefault(length, []).append(row)
    tables = block_tables.tolist()
    blocks: list[int] = []
    groups = []
    for length, rows in by_length.items():
        width = -(-length // block_size)
        start = len(blocks) * block_size
        for row in rows:
            blocks += tables[row][:width]
        groups.append(LengthGroup(_run(rows) or torch.tensor(rows), length, start, len(rows), width * block_size))
    order = [row for rows in by_length.values() for row in rows]
    # (a dropped block, -1, comes first in its table: read as block 0, never a run's start)
    block_run = _run(blocks) if blocks[0] >= 0 else None
    return DecodeContexts(
        blocks=block_run or torch.tensor(blocks).clamp_(min=0),
        groups=groups,
        order=None if _run(order) == slice(0, len(order)) else torch.tensor(order),
    )


def _run(ids: list[int]) -> slice | None:
    """``ids`` as a slice where they are consecutive, ascending."""
    return slice(ids[0], ids[0] + len(ids)) if ids == list(range(ids[0], ids[0] + len(ids))) else None
