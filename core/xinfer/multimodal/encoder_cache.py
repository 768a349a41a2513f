"""Encoder outputs by item content, so that an image seen again is not encoded again."""

from __future__ import annotations

from collections import OrderedDict

from torch import Tensor


class EncoderCache:
    """Least-recently-used encoder outputs, keyed by :attr:`MultiModalItem.content_hash`, up to
    ``max_embeddings`` rows in all (an output larger than that is used and not kept)."""

    def __init__(self, max_embeddings: int):
        self.max_embeddings = max_embeddings
        self._outputs: OrderedDict[int, Tensor] = OrderedDict()
        self._size = 0
        self.hits = 0  # lookups served
        self.misses = 0  # lookups that had to encode

    def __len__(self) -> int:
        return len(self._outputs)

    def get(self, key: int) -> Tensor | None:
        output = self._outputs.get(key)
        if output is None:
            self.misses += 1
            return None
        self._outputs.move_to_end(key)
        self.hits += 1
        return output

    def put(self, key: int, output: Tensor) -> None:
        if key in self._outputs or output.shape[0] > self.max_embeddings:
            return
        while self._outputs and self._size + output.shape[0] > self.max_embeddings:
            _, evicted = self._outputs.popitem(last=False)
            self._size -= evicted.shape[0]
        self._outputs[key] = output
        self._size += output.shape[0]
