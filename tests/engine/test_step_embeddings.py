"""A step's image embeddings (``gather_embeddings``): every image the step's chunks reach and the
encoder cache lacks goes through the encoder in ONE call (the CUDA encoder attention then takes
them all in one launch), each once, whatever the number of chunks that cover it."""

from __future__ import annotations

import torch

from xinfer.multimodal import EncoderCache, MultiModalItem, PlaceholderRange
from xinfer.multimodal.step import gather_embeddings, slices_of


def item(key: int, rows: int) -> MultiModalItem:
    return MultiModalItem("image", key, {"pixels": torch.full((1,), float(key))}, rows)


def test_the_images_of_a_step_are_encoded_in_one_call_each_once():
    calls: list[list[int]] = []

    def encode(modality, items):
        calls.append([i.content_hash for i in items])
        return [torch.full((i.num_embeddings, 2), float(i.content_hash)) for i in items]

    cache = EncoderCache(100)
    cache.put(7, torch.full((3, 2), 7.0))  # encoded by an earlier step
    a, b, cached = item(1, 4), item(2, 2), item(7, 3)
    first = [PlaceholderRange(1, a), PlaceholderRange(6, cached)]
    second = [PlaceholderRange(0, b), PlaceholderRange(3, a)]  # the same image again, in another sequence
    slices = slices_of(first, 0, 0, 10) + slices_of(second, 10, 0, 5)  # the second chunk cuts image a
    out = gather_embeddings(slices, encode, cache, torch.device("cpu"))
    assert calls == [[1, 2]]
    expected_rows = [*range(1, 5), *range(6, 9), *range(10, 12), *range(13, 15)]
    assert out.rows.tolist() == expected_rows
    assert out.embeddings[:, 0].tolist() == [1.0] * 4 + [7.0] * 3 + [2.0] * 2 + [1.0] * 2
    gather_embeddings(slices, encode, cache, torch.device("cpu"))
    assert calls == [[1, 2]]  # all cached now
