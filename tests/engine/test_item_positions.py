"""Positions the engine gives a model around items that advance them by fewer than their tokens
(``MultiModalItem.num_positions``), and the KV indexes that stay as they were."""

from __future__ import annotations

import torch

from xinfer.engine.sequence import Sequence
from xinfer.multimodal import MultiModalItem, PlaceholderRange
from xinfer.sampling import SamplingParams


def item(tokens: int, positions: int | None) -> MultiModalItem:
    return MultiModalItem("image", tokens, {"pixels": torch.zeros(1)}, tokens, num_positions=positions)


def sequence(length: int, *ranges: PlaceholderRange) -> Sequence:
    return Sequence("s", list(range(length)), SamplingParams(), multimodal=list(ranges))


def test_tokens_after_an_item_move_back_by_its_missing_positions():
    seq = sequence(
        20, PlaceholderRange(3, item(6, 2)), PlaceholderRange(12, item(4, 4)), PlaceholderRange(17, item(2, 1))
    )
    # before the first: indexes; inside it: indexes; after it: 4 back; the second item changes nothing,
    # the third moves the last token back once more
    assert seq.positions(0, 20) == [*range(9), *range(5, 15), 14]


def test_a_chunk_and_a_decode_token_get_the_positions_of_the_whole_prompt():
    seq = sequence(12, PlaceholderRange(2, item(6, 3)))
    whole = seq.positions(0, 12)
    assert seq.positions(5, 10) == whole[5:10]
    seq.token_ids.append(99)
    assert seq.positions(12, 13) == [12 - 3]


def test_items_with_a_position_each_keep_the_indexes():
    seq = sequence(10, PlaceholderRange(2, item(4, None)))
    assert seq.positions(0, 10) == list(range(10))
