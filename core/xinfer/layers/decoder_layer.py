"""Decoder layers: an attention block and an MLP block around the residual stream, the
two told apart only by where the norms sit. Any attention or MLP module of the signatures
``attn(positions, x)`` and ``mlp(x)`` slots in.

The stream ``x`` is carried as ``h + residual``, so that each add fuses into the next norm.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from xinfer.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """Pre-norm (Llama): ``x += attn(norm(x)); x += mlp(norm(x))``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm: Callable[[], RMSNorm]):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()  # HF's name of the norm before the MLP

    def forward(self, positions: Tensor, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        h, residual = _add_and_norm(self.input_layernorm, h, residual)
        h = self.self_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class SandwichDecoderLayer(nn.Module):
    """Norms around each block (Gemma 2/3): ``x += norm(attn(norm(x))); x += norm(mlp(norm(x)))``."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, norm: Callable[[], RMSNorm]):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def forward(self, positions: Tensor, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        h, residual = _add_and_norm(self.input_layernorm, h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


def _add_and_norm(norm: RMSNorm, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(norm(h + residual), h + residual)``; the first layer has no residual yet."""
    if residual is None:
        return norm(h), h
    return norm(h, residual)
