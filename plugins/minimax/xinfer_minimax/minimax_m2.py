"""MiniMax-M2 (and M2.1, M2.5): Llama-shaped layers whose MLP is a mixture of experts on every
layer, with q and k RMS-normed over all their heads together."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from xinfer.distributed import current
from xinfer.layers import (
    DecoderForCausalLM,
    DecoderSpec,
    MoE,
    RMSNorm,
    RotaryEmbedding,
    Routing,
    SelfAttention,
    SplitRMSNorm,
)
from xinfer.loading.mtp import without_mtp_layers
from xinfer.loading.stored import StoredTensor, Weights

# checkpoint names -> the model's (transformers' own, but the correction bias, which the router holds here)
_RENAMES = [
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.mlp\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
]


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    """Rotary over the halves (NeoX) of each head's first ``rotary_dim``; experts picked by sigmoid
    scores plus a correction bias, their weights renormalized; no shared experts. MTP layers after
    the decoder's are skipped."""

    spec = DecoderSpec(qkv_bias=False, o_bias=False, mlp_bias=False, partial_rotary=True, sliding_window=False)

    def rope_parameters(self, config: Any, layer_type: str | None) -> dict[str, Any]:
        params = super().rope_parameters(config, layer_type)
        # the checkpoints give rotary_dim, which transformers 5.17 and older leave out of the rope parameters
        explicit = "partial_rotary_factor" in (getattr(config, "rope_parameters", None) or {})
        if not explicit and getattr(config, "partial_rotary_factor", None) is None:
            params["partial_rotary_factor"] = (getattr(config, "rotary_dim", None) or self.head_dim) / self.head_dim
        return params

    def attention(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        return MiniMaxM2Attention(config.hidden_size, heads, kv_heads, self.head_dim, rotary, config.rms_norm_eps)

    def mlp(self, config: Any, index: int) -> nn.Module:
        routing = Routing(
            top_k=config.num_experts_per_tok,
            scoring=getattr(config, "scoring_func", "sigmoid"),
            renormalize=True,
            correction_bias=True,
        )
        if routing.scoring != "sigmoid":
            raise ValueError(f"scoring_func {routing.scoring!r} is not supported: MiniMax-M2 routes by sigmoid scores")
        return MoE(config.hidden_size, config.num_local_experts, config.intermediate_size, routing, config.hidden_act)

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(_renamed(without_mtp_layers(weights, self.config.num_hidden_layers)))


def _renamed(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    for name, tensor in weights:
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
        yield name, tensor


class MiniMaxM2Attention(SelfAttention):
    """Self-attention whose q and k are RMS-normed across all heads (one norm of ``heads * head_dim``)
    before rotary, rather than head by head (under tensor parallelism, across the ranks' heads)."""

    q_norm: RMSNorm
    k_norm: RMSNorm

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding, eps: float
    ):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, rotary)
        tp = current()
        self.q_norm = SplitRMSNorm(num_heads * head_dim, tp.split(num_heads, "attention heads"), eps)
        self.k_norm = SplitRMSNorm(num_kv_heads * head_dim, tp.heads(num_kv_heads, "KV heads"), eps)

    def heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v = self.qkv_proj.split(qkv)
        q = self.q_norm(q).view(-1, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v, None, None
