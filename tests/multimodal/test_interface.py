"""The multimodal core without a model: prompt expansion, the encoder cache's bound, per-chunk slices, the
prefix-cache key and where prefill chunks may end."""

import pytest
import torch

from xinfer.engine.sequence import Sequence
from xinfer.multimodal import EncoderCache, MultiModalItem, PlaceholderRange, expand_prompt
from xinfer.multimodal.step import slices_of
from xinfer.sampling import SamplingParams

PLACEHOLDER = 9


class Processor:
    """Each image becomes [7, e, e, ..., 8]: its embeddings after the start marker."""

    placeholders = {"image": PLACEHOLDER}
    merges = {(3, 7): 6, (8, 3): 4}  # pairs written together as one token (as Gemma 3's newlines are)

    def process(self, modality, data):
        return item(data)

    def replacement(self, item):
        return [7, *[5] * item.num_embeddings, 8], 1


def item(size: int, key: int | None = None) -> MultiModalItem:
    return MultiModalItem("image", key if key is not None else size, {}, size)


def test_each_placeholder_becomes_its_items_tokens_in_order():
    ids, ranges = expand_prompt(Processor(), [1, PLACEHOLDER, 2, PLACEHOLDER], [item(3), item(2)])
    assert ids == [1, 7, 5, 5, 5, 8, 2, 7, 5, 5, 8]
    assert [(r.offset, r.end, r.item.num_embeddings) for r in ranges] == [(2, 5, 3), (8, 10, 2)]


def test_a_token_beside_a_replacement_merges_with_it_where_the_processor_says():
    """A 3 before the start marker (7) and after the end marker (8) merges with it; not a 3 and 7 both the prompt's."""
    ids, ranges = expand_prompt(Processor(), [1, 3, PLACEHOLDER, 3, 3, 7, PLACEHOLDER], [item(2), item(1)])
    assert ids == [1, 6, 5, 5, 4, 3, 7, 7, 5, 8]
    assert [(r.offset, r.end) for r in ranges] == [(2, 4), (8, 9)]


def test_placeholders_and_items_must_agree():
    with pytest.raises(ValueError, match=r"1 image placeholder.*for 2 image"):
        expand_prompt(Processor(), [1, PLACEHOLDER], [item(3), item(2)])


def test_the_encoder_cache_keeps_the_most_recent_within_its_bound():
    cache = EncoderCache(max_embeddings=10)
    for key in (1, 2, 3):
        cache.put(key, torch.zeros(4, 2))
    assert cache.get(1) is None and cache.get(2) is not None and cache.get(3) is not None  # 12 > 10: 1 went
    cache.put(4, torch.zeros(4, 2))  # 2 was read before 3: the least recently used goes
    assert cache.get(2) is None and cache.get(3) is not None and cache.get(4) is not None
    cache.put(5, torch.zeros(11, 2))  # larger than the whole cache: not kept
    assert cache.get(5) is None and len(cache) == 2
    assert (cache.hits, cache.misses) == (4, 3)


def test_a_chunk_takes_the_slices_of_the_items_it_covers():
    ranges = [PlaceholderRange(2, item(3)), PlaceholderRange(8, item(2))]
    pieces = slices_of(ranges, row=100, start=4, end=9)
    assert [(p.row, p.first, p.last, p.range.offset) for p in pieces] == [(100, 2, 3, 2), (104, 0, 1, 8)]


def sequence(whole_items: bool) -> Sequence:
    ranges = [PlaceholderRange(2, item(5, key=111)), PlaceholderRange(20, item(4, key=222))]
    return Sequence("s", list(range(40)), SamplingParams(), multimodal=ranges, whole_items=whole_items)


def test_block_keys_hold_the_images_in_the_block():
    seq = sequence(False)
    assert seq.block_key(0, 16) == (*range(16), 111)
    assert seq.block_key(16, 32) == (*range(16, 32), 222)
    assert seq.block_key(32, 40) == tuple(range(32, 40))


def test_chunks_keep_items_whole_only_where_the_model_asks():
    assert sequence(False).chunk_end(0, 4) == 4  # cuts the first item
    seq = sequence(True)
    assert seq.chunk_end(0, 4) == 2  # ends before it
    assert seq.chunk_end(0, 7) == 7 and seq.chunk_end(0, 22) == 20
    assert seq.chunk_end(4, 6) == 4  # starts inside it (a prefix hit) and cannot finish it: waits
    assert seq.chunk_end(4, 7) == 7
