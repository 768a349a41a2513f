"""Decoder layers: an attention block and an MLP block around the residual stream, the
two told apart only by where the norms sit. Any attention or MLP module of the signatures
``attn(positions, x)`` and ``mlp(x)`` slots in.

The stream ``x`` is carried as ``h + residual``, so that each add fuses into the next norm;
a block that projects its input first (:class:`NormsItsInput`) takes that norm too, into its
projection's prologue (:func:`xinfer.ops.norm_linear`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

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
        h, residual = normed_block(self.self_attn, self.input_layernorm, h, residual, positions)
        return normed_block(self.mlp, self.post_attention_layernorm, h, residual)


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
        h, residual = normed_block(self.self_attn, self.input_layernorm, h, residual, positions)
        h, residual = normed_block(self.mlp, self.pre_feedforward_layernorm, self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(h), residual


class NormsItsInput(Protocol):
    """A block whose first step is a projection of its (normalized) input, which takes the
    norm before it into that projection (:meth:`RMSNorm.project`): ``forward_norm(*args,
    norm, h, residual)`` is ``(block(*args, norm(h + residual)), h + residual)``. A subclass
    that changes ``forward`` must change ``forward_norm`` alike."""

    def forward_norm(self, *args: Any) -> tuple[Tensor, Tensor]: ...


def normed_block(
    block: nn.Module, norm: RMSNorm, h: Tensor, residual: Tensor | None, *args: Any
) -> tuple[Tensor, Tensor]:
    """``(block(*args, norm(h + residual)), h + residual)``; the first layer has no residual
    yet (``h`` is the stream). A :class:`NormsItsInput` block applies the norm itself."""
    # a NormsItsInput, found by its method: isinstance on a runtime Protocol costs ~17 µs a call
    forward_norm = getattr(block, "forward_norm", None)
    if forward_norm is not None:
        return forward_norm(*args, norm, h, residual)
    if residual is None:
        return block(*args, norm(h)), h
    h, residual = norm(h, residual)
    return block(*args, h), residual
