"""A step's multimodal inputs: which rows of the flat batch take which encoder embeddings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer.multimodal.encoder_cache import EncoderCache
from xinfer.multimodal.inputs import MultiModalItem, PlaceholderRange


@dataclass(frozen=True)
class MultiModalSlice:
    """Rows ``row`` to ``row + last - first`` of a step take embeddings ``first:last`` of ``range.item``
    (a prefill chunk may cover part of an item)."""

    row: int
    range: PlaceholderRange
    first: int
    last: int


def slices_of(ranges: Sequence[PlaceholderRange], row: int, start: int, end: int) -> list[MultiModalSlice]:
    """The slices of the items in ``ranges`` that prompt positions ``start:end`` (at rows from
    ``row``) cover."""
    found = []
    for r in ranges:
        first, last = max(start, r.offset), min(end, r.end)
        if first < last:
            found.append(MultiModalSlice(row + first - start, r, first - r.offset, last - r.offset))
    return found


@dataclass(frozen=True)
class MultiModalEmbeddings:
    """What a step's model forward reads (:func:`xinfer.forward_context.multimodal`): the
    encoder embeddings ``embeddings`` [N, D] that go to rows ``rows`` [N] of the flat batch."""

    rows: Tensor
    embeddings: Tensor
    slices: list[MultiModalSlice]  # where they come from, in the order of the rows

    def merge(self, hidden: Tensor) -> Tensor:
        """``hidden`` [T, D] with the embeddings written over their rows."""
        return hidden.index_copy(0, self.rows, self.embeddings.to(hidden.dtype))


Encoder = Callable[[str, Sequence[MultiModalItem]], list[Tensor]]


def gather_embeddings(
    slices: list[MultiModalSlice], encode: Encoder, cache: EncoderCache, device: torch.device
) -> MultiModalEmbeddings:
    """Each slice's embeddings, from ``cache`` or (once per item, batched per modality) ``encode``."""
    outputs: dict[int, Tensor] = {}
    missing: dict[str, dict[int, MultiModalItem]] = {}
    for s in slices:
        item = s.range.item
        if item.content_hash in outputs or item.content_hash in missing.get(item.modality, {}):
            continue
        cached = cache.get(item.content_hash)
        if cached is None:
            missing.setdefault(item.modality, {})[item.content_hash] = item
        else:
            outputs[item.content_hash] = cached
    for modality, items in missing.items():
        for key, output in zip(items, encode(modality, list(items.values()))):
            cache.put(key, output)
            outputs[key] = output
    rows = torch.cat([torch.arange(s.row, s.row + s.last - s.first) for s in slices])
    embeddings = torch.cat([outputs[s.range.item.content_hash][s.first : s.last] for s in slices])
    return MultiModalEmbeddings(rows.to(device), embeddings, slices)
