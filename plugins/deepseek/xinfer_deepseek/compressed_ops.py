"""DeepSeek V4's compressed attention over paged caches: the ops' plain-torch references.

A compressed layer pools every ``m`` (``ratio``) tokens into one entry. Each token's projected
``kv`` and ``gate`` rows (``width`` values each) are cached in a window of the last ``overlap * m``
positions (``compress_windows`` stores them); the token closing window ``w`` (position
``(w + 1) m - 1``) pools them::

    entry[w] = sum_j softmax_j(gate_j + position_bias) * kv_j

over the ``m`` tokens of window ``w`` (HCA, ``overlap`` 1), or, with ``overlap`` 2 (CSA), over
``2 m`` slots: the first half of every row (``Ca``) of window ``w - 1`` and the second half
(``Cb``) of window ``w`` (window 0's ``Ca`` slots are empty: weight 0). The layer then norms and
rotates the pooled row and stores it in its compressed cache (``TokenVectorSpec(ratio=m)``),
where ``v4_attention`` and ``compressed_indexer_topk`` read it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.cache.specs import compressed_rows, compressed_slots
from xinfer.ops import AttentionMetadata
from xinfer.torch_ops import gather_context
from xinfer_deepseek.mla_ops import store


def compress_windows(
    kv: Tensor, gate: Tensor, cache: Tensor, meta: AttentionMetadata, position_bias: Tensor, ratio: int, overlap: int
) -> Tensor:
    """Store this step's ``kv`` and ``gate`` [T, overlap * D] in ``cache`` [num_blocks, block_size,
    2 * overlap * D] at ``meta.slot_mapping``, then pool every window a token of this step closes
    (the module's docstring), in fp32. Returns [T, D] in the dtype of ``kv``: the pooled entry at
    the row of the token closing its window, zeros elsewhere."""
    store(cache, torch.cat([kv, gate], dim=-1).to(cache.dtype), meta.slot_mapping)
    width = kv.shape[-1] // overlap
    out = torch.zeros(kv.shape[0], width, dtype=torch.float32, device=kv.device)
    cu = meta.cu_seqlens_q.tolist()
    for b, context_len in enumerate(meta.seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        first_pos = context_len - (end - start)
        first_window, windows = first_pos // ratio, context_len // ratio - first_pos // ratio
        if end == start or windows <= 0:
            continue
        lo = (first_window - overlap + 1) * ratio  # the first position the step's windows read
        rows = gather_context(cache, meta.block_tables[b], (first_window + windows) * ratio, max(lo, 0)).float()
        kv_rows, gate_rows = rows.split(overlap * width, dim=-1)
        if lo < 0:  # window 0 of an overlapping pool: its previous window's slots weigh nothing
            kv_rows = torch.cat([kv_rows.new_zeros(-lo, kv_rows.shape[1]), kv_rows])
            gate_rows = torch.cat([gate_rows.new_full((-lo, gate_rows.shape[1]), float("-inf")), gate_rows])
        kv_win = kv_rows.view(-1, ratio, overlap * width)  # [windows + overlap - 1, m, overlap * D]
        gate_win = gate_rows.view(-1, ratio, overlap * width) + position_bias.float()
        if overlap == 2:  # window w: Ca of window w - 1, then Cb of window w
            kv_win = torch.cat([kv_win[:-1, :, :width], kv_win[1:, :, width:]], dim=1)
            gate_win = torch.cat([gate_win[:-1, :, :width], gate_win[1:, :, width:]], dim=1)
        pooled = (kv_win * gate_win.softmax(dim=1)).sum(dim=1)  # [windows, D]
        closing = (torch.arange(first_window, first_window + windows, device=kv.device) + 1) * ratio - 1
        out[start + closing - first_pos] = pooled
    return out.to(kv.dtype)


def compressed_context(cache: Tensor, block_table: Tensor, count: int, ratio: int, block_size: int) -> Tensor:
    """One sequence's first ``count`` entries [count, D] of the ``ratio`` cache ``cache``."""
    return cache.view(-1, cache.shape[-1])[compressed_rows(block_table, count, ratio, block_size)]


def write_compressed(
    entries: Tensor, cache: Tensor, slot_mapping: Tensor, positions: Tensor, ratio: int, block_size: int
) -> None:
    """Rows ``entries`` [T, D] of the tokens (at ``positions``) closing a window into the ``ratio``
    cache ``cache`` [num_blocks, rows_per_block, D]; the other rows are skipped."""
    store(cache, entries.to(cache.dtype), compressed_slots(slot_mapping, positions, ratio, block_size))


def query_positions(meta: AttentionMetadata, b: int) -> Tensor:
    """The positions of sequence ``b``'s queries in this step."""
    start, end = int(meta.cu_seqlens_q[b]), int(meta.cu_seqlens_q[b + 1])
    context_len = int(meta.seq_lens[b])
    return torch.arange(context_len - (end - start), context_len, device=meta.seq_lens.device)


def compressed_indexer_topk(
    q: Tensor,
    weights: Tensor,
    cache: Tensor,
    meta: AttentionMetadata,
    ratio: int,
    block_size: int,
    scale: float,
    topk: int,
) -> Tensor:
    """The lightning indexer of a compressed layer: for each query ``q`` [T, H, D] (its heads weighed
    by ``weights`` [T, H]) the ``topk`` of its sequence's indexer entries (``cache``, a ``ratio``
    cache [num_blocks, rows_per_block, D]) with the best index score, among those it sees (entry
    ``w`` is seen from position ``(w + 1) * ratio - 1`` on)::

        index[t, w] = sum_h weights[t, h] * relu(q[t, h] . entry_w) * scale

    in fp32. Returns [T, topk] int32 entry numbers, unordered; -1 pads a query that sees fewer."""
    selected = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    cu = meta.cu_seqlens_q.tolist()
    for b, context_len in enumerate(meta.seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        count = context_len // ratio
        if end == start or count == 0:
            continue
        entries = compressed_context(cache, meta.block_tables[b], count, ratio, block_size).float()
        scores = torch.relu(torch.einsum("qhd,kd->qhk", q[start:end].float(), entries)) * scale
        index = torch.einsum("qh,qhk->qk", weights[start:end].float(), scores)
        seen = torch.arange(count, device=q.device)[None, :] < (query_positions(meta, b)[:, None] + 1) // ratio
        best, chosen = index.masked_fill(~seen, float("-inf")).topk(min(topk, count), dim=-1)
        selected[start:end, : chosen.shape[1]] = chosen.masked_fill(best == float("-inf"), -1).int()
    return selected


def v4_attention(
    q: Tensor,
    kv: Tensor,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: Tensor,
    window: int,
    compressed: CompressedKeys | None = None,
) -> Tensor:
    """Store this step's shared key-value rows ``kv`` [T, D] in ``cache`` [num_blocks, block_size, D]
    at ``meta.slot_mapping``, then each query of ``q`` [T, H, D] attends, in fp32, over its
    sequence's rows at positions ``p - window < j <= p``, the compressed entries it reads (where
    ``compressed``: all it sees, or the indexer's selection) and its head's sink, a logit
    ``sinks[h]`` with no value::

        out[t, h] = sum_j softmax_j([s[t, h, :], sinks[h]])_j * row_j,  s = scale * q[t, h] . row

    The rows are keys and values alike. Returns [T, H, D] in the dtype of ``q``."""
    store(cache, kv.to(cache.dtype), meta.slot_mapping)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = meta.cu_seqlens_q.tolist()
    for b, context_len in enumerate(meta.seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        first = max(0, context_len - (end - start) - window + 1)
        rows = gather_context(cache, meta.block_tables[b], context_len, first).float()  # [L, D]
        q_pos = query_positions(meta, b)
        k_pos = torch.arange(first, context_len, device=q.device)
        visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - window)
        if compressed is not None:
            entries, seen = compressed.read(b, q_pos, start, end)
            rows, visible = torch.cat([rows, entries]), torch.cat([visible, seen], dim=1)
        scores = scale * torch.einsum("qhd,kd->qhk", q[start:end].float(), rows)
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        sink = sinks.float()[None, :, None].expand(end - start, -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        out[start:end] = torch.einsum("qhk,kd->qhd", probs, rows)
    return out.to(q.dtype)


class CompressedKeys:
    """A compressed layer's entries as :func:`v4_attention` reads them: the ``ratio`` cache
    ``cache`` of the page group ``meta`` describes, and which entries each query reads: all it
    sees (``selected`` None: HCA) or the ``selected`` [T, K] ones (-1: none; CSA's indexer)."""

    def __init__(self, cache: Tensor, meta: AttentionMetadata, ratio: int, block_size: int, selected: Tensor | None):
        self.cache, self.meta, self.ratio, self.block_size, self.selected = cache, meta, ratio, block_size, selected

    def read(self, b: int, q_pos: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Sequence ``b``'s entries [N, D] (fp32) and which of them each query reads [Q, N]."""
        count = int(self.meta.seq_lens[b]) // self.ratio
        entries = compressed_context(self.cache, self.meta.block_tables[b], count, self.ratio, self.block_size)
        numbers = torch.arange(count, device=q_pos.device)
        if self.selected is None:
            return entries.float(), numbers[None, :] < (q_pos[:, None] + 1) // self.ratio
        chosen = self.selected[start:end].long()
        read = torch.zeros(end - start, count + 1, dtype=torch.bool, device=q_pos.device)
        read.scatter_(1, torch.where(chosen >= 0, chosen, count), True)
        return entries.float(), read[:, :count]
