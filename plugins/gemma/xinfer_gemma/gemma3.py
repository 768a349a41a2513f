"""Gemma 3 (text): sliding-window layers interleaved with global ones.

Differences from Llama: embeddings scaled by sqrt(hidden); norms after attention and after
the MLP too (sandwich norms); RMSNorm on each q/k head; a rope base per layer kind; queries
scaled by ``query_pre_attn_scalar**-0.5``; gelu-tanh MLP; optional final logit soft-capping.
Gemma's RMSNorm multiplies by ``1 + w``: ``load_weights`` adds the 1 so the core RMSNorm
(``x * w``) computes the same.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import Tensor, nn

from xinfer.layers import (
    Attention,
    GeluTanhAndMul,
    Linear,
    LMHead,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    head_norms,
    rope_parameters,
)
from xinfer.model import HF_QKV_GATE_UP, CausalLM


def layer_type_of(config: Any, layer_index: int) -> str:
    return config.layer_types[layer_index]


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary
        sliding = layer_type_of(config, layer_index) == "sliding_attention"
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=config.query_pre_attn_scalar**-0.5,
            window=config.sliding_window if sliding else None,
            # no attn_logit_softcapping: Gemma 3 replaced it by q/k norms, and neither HF nor
            # llama.cpp applies it even when a config still carries the Gemma 2 value
        )

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k, head_norms(self.q_norm, self.k_norm))
        return self.o_proj(self.attn(q, k, v))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size})
        self.down_proj = Linear(size, config.hidden_size)
        self.act_fn = GeluTanhAndMul()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """``x += post_attn_norm(attn(input_norm(x))); x += post_ffw_norm(mlp(pre_ffw_norm(x)))``,
    with ``x`` carried as ``h + residual`` so each add fuses into the next norm."""

    def __init__(self, config: Any, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_index, rotary)
        self.mlp = Gemma3MLP(config)
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def forward(self, positions: Tensor, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        rotary = {
            kind: RotaryEmbedding(config.head_dim, config.max_position_embeddings, rope_parameters(config, kind))
            for kind in sorted(set(config.layer_types))
        }
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden) rounded to the model dtype, as the reference does (55.4256 is 55.5 in bf16)
        scale = torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, rotary[layer_type_of(config, i)])
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h, residual = self.embed_tokens(input_ids) * self.embed_scale, None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.norm(h, residual)
        return h


class Gemma3ForCausalLM(CausalLM):
    packed_modules = HF_QKV_GATE_UP

    def __init__(self, config: Any):
        super().__init__(config)
        self.model = Gemma3Model(config)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, softcap=config.final_logit_softcapping)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return super().load_weights(
            (name, tensor + 1.0 if name.endswith("norm.weight") else tensor) for name, tensor in weights
        )
