"""DeepSeek V4's rotary: adjacent pairs of the *last* ``rotary_dim`` dims of each head rotate, and the
attention output is rotated back (the inverse rotation at the query's position), so that what a
query reads of a row's rotated part depends only on their distance."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from xinfer.layers.rotary import inverse_frequencies


class TailRotary(nn.Module):
    """Rotates ``x`` [T, ..., D] at ``positions`` [T]; the angles come from the rope parameters (YaRN
    included) as core's rotary computes them, here per call rather than from a table (V4's context is
    a million positions)."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, params: dict[str, Any]):
        super().__init__()
        if params["rope_type"] == "longrope":
            # transformers picks the short or long factors per call by the largest position it rotates (the
            # step's, the compressed entries'), a choice no paged step reproduces
            raise ValueError("rope_type 'longrope' is not supported by DeepSeek-V4's rotary")
        inv_freq, self.mscale = inverse_frequencies(head_dim, params)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor, inverse: bool = False) -> Tensor:
        angles = positions.float()[:, None] * self.inv_freq  # [T, R / 2]
        shape = (angles.shape[0],) + (1,) * (x.dim() - 2) + (angles.shape[1],)
        cos, sin = (angles.cos() * self.mscale).view(shape), (angles.sin() * self.mscale).view(shape)
        if inverse:
            sin = -sin
        rotary_dim = 2 * angles.shape[1]
        rest, pairs = x[..., :-rotary_dim], x[..., -rotary_dim:].float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((rest, rotated.to(x.dtype)), dim=-1)
