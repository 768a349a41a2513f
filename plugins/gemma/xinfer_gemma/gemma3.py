"""Gemma 3 (text): sliding-window layers interleaved with global ones, each kind with its
own rope base (``layer_types`` and the per-type rope parameters of the config)."""

from typing import Any

import torch

from xinfer.layers import DecoderForCausalLM, DecoderSpec


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Llama with embeddings scaled by sqrt(hidden), norms after attention and after the MLP
    too (sandwich), RMSNorm on each q/k head, norms that multiply by ``1 + w``; queries
    scaled by ``query_pre_attn_scalar**-0.5``, a gelu-tanh MLP and the final logit
    soft-capping come from the config.

    No attention logit soft-capping: Gemma 3 replaced it by q/k norms, and neither HF nor
    llama.cpp applies it even when a config still carries the Gemma 2 value.
    """

    spec = DecoderSpec(
        mlp_bias=False, activation="hidden_activation", query_pre_attn_scalar=True, final_logit_softcapping=True,
        qk_norm=True, sandwich_norms=True, norm_weight_offset=1.0, scale_embeddings=True,
    )  # fmt: skip
    unstable_dtypes = {torch.float16: "its activations outgrow float16's range (vLLM refuses it too)"}

    def __init__(self, config: Any):
        if getattr(config, "use_bidirectional_attention", False):  # EmbeddingGemma's encoder
            raise NotImplementedError("Gemma 3 with use_bidirectional_attention=True is not a causal LM xinfer serves")
        super().__init__(config)

    def rope_parameters(self, config: Any, layer_type: str | None) -> dict[str, Any]:
        if layer_type == "sliding_attention" and not getattr(config, "rope_parameters", None):
            # transformers 4 keeps the sliding layers' base apart, unscaled (5 reads it into rope_parameters)
            return {"rope_type": "default", "rope_theta": config.rope_local_base_freq, "partial_rotary_factor": 1.0}
        return super().rope_parameters(config, layer_type)
