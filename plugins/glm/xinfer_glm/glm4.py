"""GLM-4 (0414): GLM (:mod:`xinfer_glm.glm`) with norms on the attention's and the MLP's outputs too."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from xinfer.layers import RMSNorm, RotaryEmbedding
from xinfer_glm.glm import GlmForCausalLM


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM's attention and MLP in the sandwich layer below."""

    unstable_dtypes = {torch.float16: "its activations outgrow float16's range (vLLM refuses it too)"}

    def layer(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        norm = functools.partial(self.rms_norm, config.hidden_size)
        return Glm4DecoderLayer(self.attention(config, index, rotary), self.mlp(config, index), norm)


class Glm4DecoderLayer(nn.Module):
    """The sandwich layer (``x += norm(attn(norm(x))); x += norm(mlp(norm(x)))``) under GLM's
    names, whose ``post_attention_layernorm`` is the norm before the MLP, as in Llama."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm: Callable[[], RMSNorm]):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_self_attn_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.post_mlp_layernorm = norm()

    def forward(self, positions: Tensor, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_self_attn_layernorm(self.self_attn(positions, h))
        h, residual = self.post_attention_layernorm(h, residual)
        return self.post_mlp_layernorm(self.mlp(h)), residual
