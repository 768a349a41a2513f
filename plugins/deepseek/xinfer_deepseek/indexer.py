"""DeepSeek V3.2's lightning indexer: which positions each query's latent attention reads.

Its query comes from the layer's q-LoRA latent (``wq_b``), its per-token key from the hidden state
(``wk``, LayerNorm), both rotated on their first ``qk_rope_head_dim`` dims in halves (not the MLA's
interleaved pairs); its per-head weights from the hidden state in fp32 (``weights_proj``). The scores,
ReLU of q . k summed over heads by those weights, and the top-k are the op ``indexer_topk``. As
transformers' modeling code, it skips the reference implementation's Hadamard rotation (orthogonal:
q . k is unchanged) and its fp8 quantization of q and k.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from xinfer import ops
from xinfer.cache.specs import TokenVectorSpec
from xinfer.forward_context import attention_metadata
from xinfer.layers import FloatLinear, Linear, RotaryEmbedding


class Indexer(nn.Module):
    """Caches each token's key (``index_head_dim`` values) in the layer's page group; returns each
    query's ``index_topk`` selected positions [T, topk] (int32, -1 padding)."""

    def __init__(self, config: Any, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.head_dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.wq_b = Linear(config.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = Linear(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = FloatLinear(config.hidden_size, self.num_heads)  # read in fp32, as the reference
        self.rotary_emb = rotary
        self.scale = self.head_dim**-0.5
        self.cache: Tensor | None = None
        self.page_group = 0

    def cache_spec(self) -> TokenVectorSpec:
        return TokenVectorSpec(self.head_dim)

    def forward(self, positions: Tensor, x: Tensor, q_resid: Tensor) -> Tensor:
        q = self.wq_b(q_resid).view(-1, self.num_heads, self.head_dim)
        key = self.k_norm(self.wk(x)).unsqueeze(1)
        q, key = self.rotary_emb(positions, q.contiguous(), key.contiguous())
        weights = ops.linear(x.float(), self.weights_proj.weight.float()) * self.num_heads**-0.5
        assert self.cache is not None, "the engine binds the indexer's cache before the first forward"
        meta = attention_metadata(self.page_group)
        return ops.call("indexer_topk", q, key.squeeze(1), weights, self.cache, meta, self.scale, self.topk)
