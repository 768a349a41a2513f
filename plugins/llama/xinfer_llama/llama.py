"""Llama and the models built like it (Mistral; Qwen2/3 and Phi3 reuse these blocks).

A decoder layer is pre-norm attention then a gated MLP, each added to the residual
stream: ``h += attn(norm(h)); h += mlp(norm(h))``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from xinfer.layers import (
    Attention,
    GeluTanhAndMul,
    Linear,
    LMHead,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMul,
    VocabEmbedding,
    head_norms,
    rope_parameters,
)
from xinfer.model import HF_QKV_GATE_UP, CausalLM

ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any, layer_index: int) -> int | None:
    """The layer's window: per ``layer_types`` when the config has them, else the
    config-wide ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_index] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    def __init__(
        self, config: Any, layer_index: int, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool
    ):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, getattr(config, "attention_bias", False))
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = rotary
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            scale=self.head_dim**-0.5,
            window=sliding_window_of(config, layer_index),
        )

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        norms = head_norms(self.q_norm, self.k_norm) if self.qk_norm else None
        q, k = self.rotary_emb(positions, q, k, norms)
        return self.o_proj(self.attn(q, k, v))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias)
        self.down_proj = Linear(size, config.hidden_size, bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]()

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_index: int, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_index, rotary, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: Tensor, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, rope_parameters(config))
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, qkv_bias, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(CausalLM):
    packed_modules = HF_QKV_GATE_UP
    qkv_bias: ClassVar[bool | None] = None  # None: the config's attention_bias
    qk_norm: ClassVar[bool] = False

    def __init__(self, config: Any):
        super().__init__(config)
        qkv_bias = self.qkv_bias if self.qkv_bias is not None else getattr(config, "attention_bias", False)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with a sliding window on every layer (``config.sliding_window``)."""
