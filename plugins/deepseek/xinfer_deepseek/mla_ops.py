"""Multi-head latent attention over a paged latent cache: the op's plain-torch reference.

Each token of a layer keeps one cache row of ``R + P`` values shared by all heads: its
normalised latent (``R`` = kv_lora_rank) followed by its rotated rope key (``P`` =
qk_rope_head_dim). Attention runs in the absorbed form: the key up-projection is folded
into the query (``q_latent``), so every head scores the same rows, and the value
up-projection follows the op, which returns each head's softmax-weighted sum of latents.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.ops import AttentionMetadata
from xinfer.torch_ops import gather_context


def mla_attention(
    q_latent: Tensor, q_rope: Tensor, latent: Tensor, cache: Tensor, meta: AttentionMetadata, scale: float
) -> Tensor:
    """Store this step's ``latent`` [T, R + P] in ``cache`` [num_blocks, block_size, R + P] at
    ``meta.slot_mapping`` (negative: skipped), then causal paged attention of the queries
    ``q_latent`` [T, H, R] and ``q_rope`` [T, H, P] over each sequence's cached rows::

        s[t, h, j] = scale * (q_latent[t, h] . row_j[:R] + q_rope[t, h] . row_j[R:]),  j <= position of t
        out[t, h] = sum_j softmax_j(s[t, h]) * row_j[:R]

    in fp32. Returns [T, H, R] in the dtype of ``q_latent``; rows of no sequence are zero."""
    rank = q_latent.shape[-1]
    written = meta.slot_mapping >= 0
    cache.view(-1, cache.shape[-1])[meta.slot_mapping[written]] = latent[written].to(cache.dtype)

    q = torch.cat([q_latent, q_rope], dim=-1).float()  # [T, H, R + P]: one dot per row
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q.device)
    cu = meta.cu_seqlens_q.tolist()
    for b, context_len in enumerate(meta.seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        rows = gather_context(cache, meta.block_tables[b], context_len).float()  # [L, R + P]
        scores = scale * torch.einsum("qhd,kd->hqk", q[start:end], rows)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,kr->qhr", probs, rows[:, :rank])
    return out.to(q_latent.dtype)
