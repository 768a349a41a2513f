"""DeepSeek-V3 (and R1, Moonlight, Kimi-style fine-tunes) and DeepSeek-V2: multi-head latent attention
in every layer; the MLP a mixture of experts after the first ``first_k_dense_replace`` layers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from xinfer.layers import DecoderForCausalLM, DecoderSpec, MoE, RotaryEmbedding, Routing, rope_parameters
from xinfer.loading.mtp import without_mtp_layers
from xinfer.loading.stored import StoredTensor, Weights
from xinfer.model import HF_QKV_GATE_UP
from xinfer_deepseek.latent_attention import PACKED_MODULES, LatentAttention

# kv_b_proj's halves as llama.cpp's converter names them, and as the module that loads them does
_CONVERTED_HALF = re.compile(r"\.self_attn\.(k_b_proj|v_b_proj)\.weight$")
_LOADED_HALF = re.compile(r"\.self_attn\.kv_b_proj\.(k_b_proj|v_b_proj)\.weight$")


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """Latent attention with interleaved rotary where ``rope_interleave``; experts picked by sigmoid
    scores plus a correction bias among the ``topk_group`` best of ``n_group`` groups, their weights
    renormalized (``norm_topk_prob``) and scaled by ``routed_scaling_factor``; shared experts see every
    token. ``kv_b_proj`` loads whole (HF checkpoints) or as the halves llama.cpp's converter splits it
    into. The MTP layers after the decoder's are skipped. No MLP has biases, whatever ``mlp_bias`` says
    (V3.2's config has the field; transformers' V3, V3.2 and GLM-4.7-Flash ignore it)."""

    spec = DecoderSpec(mlp_bias=False, sliding_window=False)
    packed_modules = {**{part: HF_QKV_GATE_UP[part] for part in ("gate_proj", "up_proj")}, **PACKED_MODULES}
    # transformers' own default rope table spans qk_rope_head_dim whatever partial_rotary_factor says
    default_rope_ignores_partial = True

    def attention(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        return LatentAttention(config, rotary, getattr(config, "rope_interleave", True))

    def rope_parameters(self, config: Any, layer_type: str | None) -> dict[str, Any]:
        params = rope_parameters(config, layer_type)
        factor, kind = params["partial_rotary_factor"], params["rope_type"]
        if factor != 1 and (kind != "default" or not self.default_rope_ignores_partial):
            # transformers sizes its other tables by the factor, then rotates every rope dim with them: a table
            # broadcast over the dims it lacks, or a shape error
            raise ValueError(
                f"partial_rotary_factor {factor} is not supported with rope_type {kind!r}: latent attention rotates "
                f"all qk_rope_head_dim dims"
            )
        return {**params, "partial_rotary_factor": 1.0}

    def is_sparse(self, config: Any, index: int) -> bool:
        return index >= config.first_k_dense_replace

    def routing(self, config: Any) -> Routing:
        return Routing(
            top_k=config.num_experts_per_tok,
            scoring="sigmoid",
            renormalize=config.norm_topk_prob,
            correction_bias=True,
            num_groups=config.n_group,
            topk_groups=config.topk_group,
            scaling_factor=config.routed_scaling_factor,
            fp32_logits=True,
        )

    def mlp(self, config: Any, index: int) -> nn.Module:
        if not self.is_sparse(config, index):
            return super().mlp(config, index)
        return MoE(
            config.hidden_size, config.n_routed_experts, config.moe_intermediate_size, self.routing(config),
            config.hidden_act, shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
            shared_name="shared_experts", shared_bias=self.mlp_bias(config),
        )  # fmt: skip

    def checkpoint_names(self) -> set[str]:
        return {_LOADED_HALF.sub(r".self_attn.\1.weight", name) for name in super().checkpoint_names()}

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(
            _halves_under_their_loader(without_mtp_layers(weights, self.config.num_hidden_layers))
        )


def _halves_under_their_loader(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    for name, tensor in weights:
        yield _CONVERTED_HALF.sub(r".self_attn.kv_b_proj.\1.weight", name), tensor


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """V3's layers, but the rotary always over adjacent pairs and the experts picked by their softmax
    scores alone (``topk_method`` greedy, as V2-Lite), their weights scaled, not renormalized; the dense and
    shared experts' projections with biases where ``mlp_bias``."""

    spec = DecoderSpec(sliding_window=False)

    def attention(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        return LatentAttention(config, rotary, interleaved_rotary=True)

    def routing(self, config: Any) -> Routing:
        if config.topk_method != "greedy":
            raise ValueError(
                f"topk_method {config.topk_method!r} is not supported: DeepSeek-V2 routes greedily here (V2-Lite's)"
            )
        return Routing(top_k=config.num_experts_per_tok, scaling_factor=config.routed_scaling_factor, fp32_logits=True)

    def mlp(self, config: Any, index: int) -> nn.Module:
        if self.is_sparse(config, index) and not config.n_shared_experts and self.mlp_bias(config):
            # transformers builds the shared expert anyway, 0 wide: its down_proj bias still adds to every token
            raise ValueError(
                "n_shared_experts 0 with mlp_bias True is not supported (transformers' DeepSeek-V2 adds the empty "
                "shared expert's down_proj bias)"
            )
        return super().mlp(config, index)
