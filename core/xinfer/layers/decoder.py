from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from xinfer.forward_context import multimodal
from xinfer.layers.embedding import VocabEmbedding
from xinfer.layers.norm import RMSNorm


class DecoderModel(nn.Module):
    """Token embeddings (times ``embed_scale``, if given; image tokens take their encoder's
    embeddings, unscaled) through the decoder layers, then a final norm: hidden states [T, hidden]."""

    embed_scale: Tensor | None

    def __init__(
        self, vocab_size: int, hidden_size: int, layers: Iterable[nn.Module], norm: RMSNorm,
        embed_scale: float | None = None,
    ):  # fmt: skip
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        # rounded to the model dtype, as the reference does (55.4256 is 55.5 in bf16)
        scale = None
        if embed_scale is not None:
            scale = torch.tensor(embed_scale, dtype=torch.float32).to(torch.get_default_dtype())
        self.register_buffer("embed_scale", scale, persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            h = h * self.embed_scale
        if (images := multimodal()) is not None:  # image tokens take their encoder's embeddings
            h = images.merge(h)
        for layer in self.layers:
            h, residual = layer(positions, h, residual)
        h, _ = self.norm(h, residual)
        return h
