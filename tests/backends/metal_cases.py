"""Caches and attention steps the Metal backend's tests share: random K/V written into a
paged cache of any format (its blocks in random order), and the metadata of a step."""

from __future__ import annotations

import math

import torch

from xinfer.kv import LayerKVCache, get_format
from xinfer.ops import AttentionMetadata

KV_HEADS = 2


def paged_case(
    fmt: str,
    dtype: torch.dtype,
    head_dim: int,
    seq_lens: list[int],
    q_lens: list[int],
    device: torch.device,
    block_size: int = 8,
) -> tuple[LayerKVCache, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """An empty cache with calibrated key transforms (as the engine sets them), K/V
    [sum(seq_lens), Hkv, D] and their slots, and a step whose queries are the last
    ``q_lens`` of each sequence."""
    kv_format = get_format(fmt)
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    order = torch.randperm(sum(blocks_per_seq))
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots: list[int] = []
    used = 0
    for b, (n, s) in enumerate(zip(blocks_per_seq, seq_lens)):
        tables[b, :n] = order[used : used + n]
        used += n
        slots += [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(s)]
    cache = kv_format.allocate(sum(blocks_per_seq) + 1, block_size, KV_HEADS, head_dim, dtype, device)
    if kv_format.rotate_keys:
        cache.key_offset = torch.randn(KV_HEADS, head_dim, device=device)
        cache.equalizer = torch.rand(KV_HEADS, head_dim, device=device) + 0.5
    total = len(slots)
    k = (torch.randn(total, KV_HEADS, head_dim) * 2).to(dtype)
    k[: total // 3, :, :3] *= 10  # outlier channels, as real keys have
    v = torch.randn(total, KV_HEADS, head_dim).to(dtype)
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64, device=device),
        max_seqlen_q=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return cache, k.to(device), v.to(device), torch.tensor(slots, dtype=torch.int64, device=device), meta
