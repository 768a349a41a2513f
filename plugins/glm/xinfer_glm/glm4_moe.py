"""GLM-4.5, 4.6 and 4.7 (``Glm4MoeForCausalLM``): Llama-shaped layers whose MLP is a mixture of
experts after the first ``first_k_dense_replace`` layers."""

from __future__ import annotations

from typing import Any

from torch import nn

from xinfer.layers import DecoderForCausalLM, DecoderSpec, MoE, RotaryEmbedding, Routing, SelfAttention
from xinfer.loading.mtp import without_mtp_layers
from xinfer.loading.stored import Weights


class Glm4MoeForCausalLM(DecoderForCausalLM):
    """Rotary over the halves (NeoX) of each head's first ``partial_rotary_factor``, biases on
    q, k and v where ``attention_bias``, per-head q/k norms where ``use_qk_norm``. Experts are
    picked by sigmoid scores plus a correction bias among the ``topk_group`` best of ``n_group``
    groups, their weights renormalized (``norm_topk_prob``) and scaled by ``routed_scaling_factor``;
    shared experts see every token. The MTP layers after the decoder's are skipped."""

    spec = DecoderSpec(mlp_bias=False, partial_rotary=True, sliding_window=False)

    def attention(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        return SelfAttention(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, self.head_dim, rotary,
            qkv_bias=config.attention_bias, qk_norm=self.rms_norm if config.use_qk_norm else None,
        )  # fmt: skip

    def mlp(self, config: Any, index: int) -> nn.Module:
        if index < config.first_k_dense_replace:
            return super().mlp(config, index)
        routing = Routing(
            top_k=config.num_experts_per_tok,
            scoring=getattr(config, "scoring_func", "sigmoid"),
            renormalize=config.norm_topk_prob,
            correction_bias=True,
            num_groups=config.n_group,
            topk_groups=config.topk_group,
            scaling_factor=config.routed_scaling_factor,
            fp32_logits=True,
        )
        if routing.scoring != "sigmoid":
            raise ValueError(f"scoring_func {routing.scoring!r} is not supported: GLM-4.5 routes by sigmoid scores")
        return MoE(
            config.hidden_size, config.n_routed_experts, config.moe_intermediate_size, routing, config.hidden_act,
            shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
            shared_name="shared_experts",
        )  # fmt: skip

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(without_mtp_layers(weights, self.config.num_hidden_layers))
