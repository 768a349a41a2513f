"""Multimodal rotary positions (M-RoPE) of Qwen3-VL and Qwen3.5: each token has three
positions, time, row and column, and each rotary frequency turns by one of them.

Text tokens have three equal positions (so text alone is plain rope). An image's tokens
share the time position ``s`` of its first token and have rows ``s + r`` and columns
``s + c`` on its merged grid; the text after it goes on from ``s + max(h, w)``, fewer
positions than the image has tokens. A sequence's positions therefore run behind its token
indices after an image by a fixed ``delta`` (negative), which decoding adds to each new
token's index.

Frequencies are assigned to axes interleaved (``mrope_interleaved``): frequency ``i`` turns
by the row where ``i % 3 == 1`` and by the column where ``i % 3 == 2``, within the first
``3 * mrope_section[axis]`` frequencies, and by the time position otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.layers import RotaryEmbedding


@dataclass(frozen=True)
class ImagePlacement:
    """An image's tokens in a prompt: the first at index ``offset``; ``grid`` (t, h, w) in
    merged tokens (one per language-model token)."""

    offset: int
    grid: tuple[int, int, int]

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def image_positions(start: int, grid: tuple[int, int, int]) -> Tensor:
    """The (time, row, column) positions [3, t * h * w] of an image's tokens, raster order
    per frame, from ``start``."""
    t, h, w = grid
    time = torch.arange(t).repeat_interleave(h * w)
    rows = torch.arange(h).repeat_interleave(w).repeat(t)
    cols = torch.arange(w).repeat(t * h)
    return torch.stack((time, rows, cols)) + start


def mrope_positions(length: int, images: Sequence[ImagePlacement]) -> tuple[Tensor, int]:
    """The positions [3, length] of a prompt of ``length`` tokens with ``images``, and its
    ``delta``: the position of the token at index ``p >= length`` is ``p + delta`` on every axis."""
    pieces, position, index = [], 0, 0
    for image in sorted(images, key=lambda image: image.offset):
        text = image.offset - index
        pieces += [
            torch.arange(position, position + text).expand(3, text),
            image_positions(position + text, image.grid),
        ]
        position += text + max(image.grid[1:])
        index = image.end
    pieces.append(torch.arange(position, position + length - index).expand(3, length - index))
    position += length - index
    return torch.cat(pieces, dim=1), position - length


def interleaved_axes(num_frequencies: int, sections: Sequence[int]) -> Tensor:
    """The axis (0 time, 1 row, 2 column) each rotary frequency turns by."""
    axes = torch.zeros(num_frequencies, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis : 3 * sections[axis] : 3] = axis
    return axes


class MRotaryEmbedding(RotaryEmbedding):
    """A layer's rotary by three positions per token: ``positions`` [3, T] (a step with image
    tokens), or [T] where every token's three are equal (plain rope). It reads the table of
    ``rotary``, which the layers share, rather than holding one."""

    axes: Tensor

    def __init__(self, rotary: RotaryEmbedding, sections: Sequence[int]):
        nn.Module.__init__(self)  # not RotaryEmbedding's: no table of its own
        self.rotary = rotary
        self.rotary_dim = rotary.rotary_dim
        half = self.rotary_dim // 2
        self.register_buffer("axes", interleaved_axes(half, sections).repeat(2), persistent=False)  # cos || sin

    def rotation(self, positions: Tensor, norms: ops.HeadNorms | None = None) -> ops.Rotation:
        if positions.dim() == 1:
            return self.rotary.rotation(positions, norms)
        tokens = torch.arange(positions.shape[-1], device=positions.device)
        return ops.Rotation(tokens, self.table(positions), norms)

    def table(self, positions: Tensor) -> Tensor:
        """Each token's cos || sin row [T, R], each frequency at its axis's position."""
        rows = self.rotary.cos_sin[positions]  # [3, T, R]
        return rows.gather(0, self.axes.expand(1, *rows.shape[1:])).squeeze(0)
