"""DeepSeek V4's attention: one shared key-value head (the rows are keys and values), a sliding
window in every layer, per-head sinks, and in its compressed layers entries pooled from every
``m`` tokens beside the window: all of them (heavily compressed attention, HCA, ``m`` = 128 in
V4), or the ``index_topk`` a lightning indexer selects (compressed sparse attention, CSA, ``m`` =
4, windows overlapping by ``m``).

What each layer caches (docs/cache-kinds.md, "Compressed entries"): the rows of the window
(``TokenVectorSpec(head_dim, window=sliding_window)``); in a compressed layer also each token's
projected ``kv || gate`` for the windows still open (``window = overlap * m``) and the entries
(``TokenVectorSpec(head_dim, ratio=m)``); a CSA layer's indexer the same at ``index_head_dim``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.cache.specs import TokenVectorSpec
from xinfer.forward_context import attention_metadata
from xinfer.layers import Linear, RMSNorm, rope_parameters
from xinfer_deepseek.compressed_ops import CompressedKeys, write_compressed
from xinfer_deepseek.tail_rotary import TailRotary


class CachedRows(nn.Module):
    """A caching layer of one per-token (or per-``ratio``-tokens) vector."""

    def __init__(self, spec: TokenVectorSpec):
        super().__init__()
        self.spec = spec
        self.cache: Tensor | None = None
        self.page_group = 0

    def cache_spec(self) -> TokenVectorSpec:
        return self.spec

    def bound(self) -> Tensor:
        assert self.cache is not None, "the engine binds every cache before the first forward"
        return self.cache


class Compressor(nn.Module):
    """Pools every ``ratio`` tokens into an entry of ``dim`` values (``compress_windows``), normed
    (``kv_norm``) and rotated at its window's first position, into its ``ratio`` cache."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: int, eps: float, rotary: TailRotary):
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        self.kv_proj = Linear(hidden, overlap * dim)
        self.gate_proj = Linear(hidden, overlap * dim)
        self.position_bias = nn.Parameter(torch.zeros(ratio, overlap * dim, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)
        self.rotary = rotary
        self.open_windows = CachedRows(TokenVectorSpec(2 * overlap * dim, window=overlap * ratio))
        self.entries = CachedRows(TokenVectorSpec(dim, ratio=ratio))

    def forward(self, positions: Tensor, x: Tensor) -> None:
        rows = self.open_windows.bound()
        pooled = ops.call(
            "compress_windows", self.kv_proj(x), self.gate_proj(x), rows,
            attention_metadata(self.open_windows.page_group), self.position_bias, self.ratio, self.overlap,
        )  # fmt: skip
        entries = self.rotary(self.kv_norm(pooled), positions + 1 - self.ratio)
        meta = attention_metadata(self.entries.page_group)
        write_compressed(entries, self.entries.bound(), meta.slot_mapping, positions, self.ratio, self.block_size)

    @property
    def block_size(self) -> int:
        return self.open_windows.bound().shape[1]

    def keys(self, positions: Tensor, x: Tensor, q_resid: Tensor) -> CompressedKeys:
        """Pools this step's windows; every entry a query sees is read (HCA)."""
        self(positions, x)
        meta = attention_metadata(self.entries.page_group)
        return CompressedKeys(self.entries.bound(), meta, self.ratio, self.block_size, None)


class Scorer(nn.Module):
    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.weights_proj = Linear(hidden, num_heads)


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressor at ``index_head_dim``, and queries from
    the q-LoRA latent; selects each query's ``index_topk`` entries (``compressed_indexer_topk``)."""

    def __init__(self, config: Any, ratio: int, rotary: TailRotary):
        if config.index_head_dim < (rotated := 2 * rotary.inv_freq.shape[0]):
            # transformers rotates the indexer's heads by the attention's rope dims: a shape error
            raise ValueError(
                f"index_head_dim {config.index_head_dim} is smaller than the {rotated} rotated dims "
                f"(head_dim * partial_rotary_factor): the indexer's heads rotate as many"
            )
        super().__init__(config.hidden_size, config.index_head_dim, ratio, 2, config.rms_norm_eps, rotary)
        self.num_heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * self.dim)
        self.scorer = Scorer(config.hidden_size, self.num_heads)

    def select(self, positions: Tensor, x: Tensor, q_resid: Tensor) -> Tensor:
        self(positions, x)
        q = self.rotary(self.q_b_proj(q_resid).view(-1, self.num_heads, self.dim), positions)
        weights = self.scorer.weights_proj(x).float() * self.num_heads**-0.5
        meta = attention_metadata(self.entries.page_group)
        return ops.call(
            "compressed_indexer_topk", q, weights, self.entries.bound(), meta, self.ratio, self.block_size,
            self.dim**-0.5, self.topk,
        )  # fmt: skip


class SparseCompressor(Compressor):
    """CSA's compressor: windows overlapping by ``ratio``, entries read as its indexer selects."""

    def __init__(self, config: Any, ratio: int, rotary: TailRotary):
        super().__init__(config.hidden_size, config.head_dim, ratio, 2, config.rms_norm_eps, rotary)
        self.indexer = Indexer(config, ratio, rotary)

    def keys(self, positions: Tensor, x: Tensor, q_resid: Tensor) -> CompressedKeys:
        self(positions, x)
        selected = self.indexer.select(positions, x, q_resid)
        meta = attention_metadata(self.entries.page_group)
        return CompressedKeys(self.entries.bound(), meta, self.ratio, self.block_size, selected)


class GroupedLinear(nn.Module):
    """``groups`` independent projections of a row's ``groups`` slices: [T, g, in] -> [T, g, out / g]
    (``weight`` [out, in], group ``i`` its rows ``i * out / g`` on)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight.view(self.groups, -1, self.weight.shape[1])  # [g, out / g, in]
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1)


def unweighted_rms_norm(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedAttention(nn.Module):
    """V4's attention block (HF names): q-LoRA queries (``q_a_proj``, ``q_a_norm``, ``q_b_proj``) each
    head normed without weight; one key-value row (``kv_proj``, ``kv_norm``); both rotated on their
    last ``qk_rope_head_dim`` dims, the output rotated back; ``sinks``; the output projected per
    group of heads (``o_a_proj``, ``o_groups`` of ``o_lora_rank``) then mixed (``o_b_proj``). Sliding
    layers rotate with the ``main`` rope, compressed ones with ``compress`` (YaRN)."""

    def __init__(self, config: Any, index: int):
        super().__init__()
        layer_type = config.layer_types[index]
        self.num_heads, self.head_dim, self.eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
        self.window, self.groups = config.sliding_window, config.o_groups
        hidden, heads = config.hidden_size, self.num_heads
        rope = "main" if layer_type == "sliding_attention" else "compress"
        self.rotary = TailRotary(self.head_dim, rope_parameters(config, rope))
        self.q_a_proj = Linear(hidden, config.q_lora_rank)
        self.q_a_norm = RMSNorm(config.q_lora_rank, self.eps)
        self.q_b_proj = Linear(config.q_lora_rank, heads * self.head_dim)
        self.kv_proj = Linear(hidden, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.o_a_proj = GroupedLinear(
            heads * self.head_dim // self.groups, self.groups * config.o_lora_rank, self.groups
        )
        self.o_b_proj = Linear(self.groups * config.o_lora_rank, hidden)
        self.sinks = nn.Parameter(torch.zeros(heads, dtype=torch.float32))
        self.compressor: Compressor | None = None
        if layer_type != "sliding_attention":
            ratio = config.compress_rates[layer_type]
            if layer_type == "compressed_sparse_attention":
                self.compressor = SparseCompressor(config, ratio, self.rotary)
            else:
                self.compressor = Compressor(hidden, self.head_dim, ratio, 1, self.eps, self.rotary)
        self.scale = self.head_dim**-0.5
        self.cache: Tensor | None = None
        self.page_group = 0

    def cache_spec(self) -> TokenVectorSpec:
        return TokenVectorSpec(self.head_dim, window=self.window)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_resid).view(-1, self.num_heads, self.head_dim), self.eps)
        q = self.rotary(q, positions)
        kv = self.rotary(self.kv_norm(self.kv_proj(x)), positions)
        compressed = self.compressor.keys(positions, x, q_resid) if self.compressor is not None else None
        assert self.cache is not None, "the engine binds the window's cache before the first forward"
        meta = attention_metadata(self.page_group)
        out = ops.call("v4_attention", q, kv, self.cache, meta, self.scale, self.sinks, self.window, compressed)
        out = self.rotary(out, positions, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.view(out.shape[0], self.groups, -1)).flatten(1))
