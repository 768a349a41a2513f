"""Qwen2-MoE and Qwen3-MoE: Qwen2 / Qwen3 whose MLPs are mixtures of experts (MiroThinker
checkpoints are Qwen3-MoE)."""

from __future__ import annotations

from typing import Any

from torch import nn

from xinfer.layers import DecoderForCausalLM, DecoderSpec, MoE, Routing
from xinfer.loading.mtp import without_mtp_layers
from xinfer.loading.stored import Weights


def is_sparse(config: Any, index: int) -> bool:
    """Whether layer ``index`` routes to experts (else it has a dense MLP), as HF decides."""
    if index in (config.mlp_only_layers or []) or config.num_experts <= 0:
        return False
    if config.decoder_sparse_step == 0:  # transformers takes (index + 1) modulo it: a division by zero
        raise ValueError("decoder_sparse_step 0 is not supported: a layer is sparse where its number is a multiple")
    return (index + 1) % config.decoder_sparse_step == 0


def routing(config: Any) -> Routing:
    return Routing(top_k=config.num_experts_per_tok, renormalize=config.norm_topk_prob)


class QwenMoeForCausalLM(DecoderForCausalLM):
    """Dense MLPs replaced by the mixture-of-experts block where :func:`is_sparse`; a
    checkpoint's multi-token-prediction layers (``mtp.*``) are skipped."""

    def mlp(self, config: Any, index: int) -> nn.Module:
        if not is_sparse(config, index):
            return super().mlp(config, index)
        return MoE(config.hidden_size, config.num_experts, config.moe_intermediate_size, routing(config),
                   config.hidden_act, **self.shared_expert(config))  # fmt: skip

    def shared_expert(self, config: Any) -> dict[str, Any]:
        return {}

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(without_mtp_layers(weights, self.config.num_hidden_layers))


class Qwen2MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen2 attention (q/k/v biases where ``qkv_bias``, the default); a shared expert on every
    token, gated by a sigmoid."""

    spec = DecoderSpec(qkv_bias="qkv_bias", o_bias=False, mlp_bias=False)

    def shared_expert(self, config: Any) -> dict[str, Any]:
        return {"shared_intermediate_size": config.shared_expert_intermediate_size, "shared_expert_gate": True}


class Qwen3MoeForCausalLM(QwenMoeForCausalLM):
    """Qwen3 attention (per-head q/k norms); no shared expert."""

    spec = DecoderSpec(qk_norm=True, mlp_bias=False)
