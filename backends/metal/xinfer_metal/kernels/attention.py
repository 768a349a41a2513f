"""Causal paged attention over the block table, reading the cache in its format in place
(paged_attention.metal)."""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata
from xinfer_metal.kernels.codecs import cache_codecs
from xinfer_metal.shaders import MetalLibrary

LIBRARY = MetalLibrary("kv_codes.metal", "paged_attention.metal")
SIMD = 32
DECODE_SIMDGROUPS = (
    8  # one query per sequence: its keys split over 8 simdgroups (MAX_SIMDGROUPS; fewer if Metal allows fewer)
)
PREFILL_SIMDGROUPS = 1  # a prompt's query rows already fill the GPU


def covers(q: Tensor, cache: LayerKVCache) -> bool:
    return cache_codecs(cache) is not None and q.shape[1] % cache.num_kv_heads == 0


def paged_attention(
    q: Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention of ``q`` [T, H, D] over ``cache`` as :meth:`xinfer.torch_ops.TorchOps.attend`
    computes it: the query brought into the keys' basis and the output back by the format,
    the stored codes decoded inside the kernel."""
    codecs = cache_codecs(cache)
    assert codecs is not None, f"no Metal kernel reads {cache.format.name} with head_dim {cache.head_dim}"
    dtype = q.dtype
    q = cache.format.prepare_query(q, cache.equalizer).float().contiguous()
    num_tokens, num_heads, head_dim = q.shape
    out = torch.zeros_like(q)
    if num_tokens:
        simdgroups = DECODE_SIMDGROUPS if meta.max_seqlen_q == 1 else PREFILL_SIMDGROUPS
        simdgroups = max(1, min(simdgroups, LIBRARY.max_threads("paged_attention") // SIMD))
        unread = torch.zeros(1, dtype=torch.float32, device=q.device)  # the scales of a plain side
        limits = meta.key_limits
        LIBRARY.launch(
            "paged_attention",
            threads=[SIMD * simdgroups * num_heads, num_tokens],
            group_size=[SIMD * simdgroups, 1],
            q=q,
            k_cache=cache["k"].view(torch.uint8),
            k_scale=cache.tensors.get("k_scale", unread),
            v_cache=cache["v"].view(torch.uint8),
            v_scale=cache.tensors.get("v_scale", unread),
            block_tables=meta.block_tables.to(torch.int32).contiguous(),
            seq_lens=meta.seq_lens.to(torch.int32).contiguous(),
            cu_seqlens_q=meta.cu_seqlens_q.to(torch.int32).contiguous(),
            key_limits=(limits if limits is not None else unread).to(torch.int32).contiguous(),
            out=out,
            num_seqs=meta.num_seqs,
            num_heads=num_heads,
            num_kv_heads=cache.num_kv_heads,
            head_dim=head_dim,
            block_size=cache.block_size,
            max_blocks=meta.block_tables.shape[1],
            k_codec=int(codecs[0]),
            v_codec=int(codecs[1]),
            scale=float(scale),
            window=window or 0,
            softcap=float(softcap or 0.0),
            has_key_limits=int(limits is not None),
        )
    return cache.format.finish_output(out).to(dtype)
