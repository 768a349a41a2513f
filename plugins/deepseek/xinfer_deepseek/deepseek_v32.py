"""DeepSeek V3.2 (``DeepseekV32ForCausalLM``): V3's layers, each query's latent attention restricted to the
``index_topk`` positions its layer's lightning indexer selects (DeepSeek Sparse Attention)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from xinfer import ops
from xinfer.cache.specs import TokenVectorSpec
from xinfer.forward_context import attention_metadata
from xinfer.layers import RotaryEmbedding
from xinfer_deepseek.deepseek import DeepseekV3ForCausalLM
from xinfer_deepseek.indexer import Indexer
from xinfer_deepseek.latent_attention import LatentAttention


class SparseLatentAttention(LatentAttention):
    """Latent attention (q-LoRA, interleaved rotary) over the positions of ``indexer``'s selection, through
    the op ``sparse_mla_attention``. The indexer reads the q-LoRA latent."""

    def __init__(self, config: Any, rotary: RotaryEmbedding):
        if not config.q_lora_rank:
            raise ValueError("DeepSeek V3.2 needs q_lora_rank: its indexer reads the q-LoRA latent")
        super().__init__(config, rotary, interleaved_rotary=True)
        self.indexer = Indexer(config, rotary)

    def cache_spec(self) -> TokenVectorSpec:
        """The latent rows in the model's dtype: the sparse op reads no fp8 rows (the KV format fp8 is refused)."""
        return TokenVectorSpec(self.kv_lora_rank + self.rope_dim)

    def rows_cache(self) -> None:
        """None: the sparse op stores the rows."""
        return None

    def attend(self, positions: Tensor, x: Tensor, projected: tuple[Tensor, Tensor, Tensor, Tensor | None]) -> Tensor:
        q_latent, q_rope, latent, q_resid = projected
        assert self.cache is not None and q_resid is not None, "a bound cache, and q-LoRA (checked at build)"
        selected = self.indexer(positions, x, q_resid)
        meta = attention_metadata(self.page_group)
        o_latent = ops.call("sparse_mla_attention", q_latent, q_rope, latent, self.cache, meta, self.scale, selected)
        return self.o_proj(self.kv_b_proj.expand(o_latent))


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """The dense and the expert layers named by ``mlp_layer_types``."""

    def attention(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        return SparseLatentAttention(config, rotary)

    def is_sparse(self, config: Any, index: int) -> bool:
        return config.mlp_layer_types[index] == "sparse"
