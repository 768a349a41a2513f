"""DeepSeek V3.2's lightning indexer over a paged cache of its keys: the op's plain-torch reference.

Each token of a layer caches one indexer key (``D`` = index_head_dim values, shared by the
indexer's heads). A query scores every position its context holds so far::

    index[t, j] = sum_h weights[t, h] * relu(scale * q[t, h] . key_j),  j <= position of t

and keeps the ``topk`` best positions, the ones the layer's sparse latent attention then reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.ops import AttentionMetadata
from xinfer.torch_ops import gather_context
from xinfer_deepseek.mla_ops import store


def indexer_topk(
    q: Tensor, key: Tensor, weights: Tensor, cache: Tensor, meta: AttentionMetadata, scale: float, topk: int
) -> Tensor:
    """Store this step's ``key`` [T, D] in ``cache`` [num_blocks, block_size, D] at ``meta.slot_mapping``
    (negative: skipped), then select for each query ``q`` [T, H, D] (weighted per head by ``weights``
    [T, H]) the ``topk`` positions of its sequence with the highest index scores, causal, in fp32.

    Returns [T, topk] int32 positions within each sequence, unordered; -1 pads a query that sees fewer
    than ``topk`` positions (it selects all it sees) and fills the rows of no sequence."""
    store(cache, key.to(cache.dtype), meta.slot_mapping)
    selected = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    cu = meta.cu_seqlens_q.tolist()
    for b, context_len in enumerate(meta.seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        keys = gather_context(cache, meta.block_tables[b], context_len).float()  # [L, D]
        scores = torch.relu(torch.einsum("qhd,kd->qhk", q[start:end].float(), keys) * scale)
        index = torch.einsum("qh,qhk->qk", weights[start:end].float(), scores)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        best, positions = index.masked_fill(~visible, float("-inf")).topk(min(topk, context_len), dim=-1)
        selected[start:end, : positions.shape[1]] = positions.masked_fill(best == float("-inf"), -1).int()
    return selected
