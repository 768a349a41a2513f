from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xinfer.cache.block_pool import BlockKey, PageTable
from xinfer.multimodal.inputs import PlaceholderRange
from xinfer.sampling import SamplingParams

if TYPE_CHECKING:
    from xinfer.grammar.matcher import Constraint

PENDING = -1
"""A token id the device has sampled and the host not yet read (the last one only)."""

LONG_CONTEXT = "long-context"
"""What a prefix-cache key of a sequence longer than the model's context switch ends with."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One generation: its tokens, how many of them have KV in the cache, and where."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_num_tokens: int = sys.maxsize  # prompt and output, by max_tokens and the context
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    pages: list[PageTable] = field(default_factory=list)  # its blocks in each page group
    state_slot: int | None = None  # with recurrent layers
    state_boundary: int = 0  # a prefix the block pools served but no state snapshot did: worth one
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks, in order
    multimodal: list[PlaceholderRange] = field(default_factory=list)  # where its images' embeddings go
    whole_items: bool = False  # a prefill chunk never ends inside one of its items (attend_within_items)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    scheduled_once: bool = False
    queued_at_step: int = 0  # the scheduler's step count when it last joined the waiting queue
    constraint: Constraint | None = None  # its structured-output grammar, following its tokens
    bad_word_ids: list[tuple[int, ...]] = field(default_factory=list)  # its params' bad_words, tokenized
    long_context: bool = False  # longer than the model's context switch when its KV was computed

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)

    def positions(self, start: int, end: int) -> list[int]:
        """The positions the model is given for tokens ``start:end``: their indexes, less the
        :attr:`PlaceholderRange.position_shift` of each item before them."""
        indexes = list(range(start, end))
        for r in self.multimodal:
            if r.position_shift and r.end < end:
                first = max(r.end, start) - start
                indexes[first:] = [p - r.position_shift for p in indexes[first:]]
        return indexes

    def block_key(self, start: int, end: int) -> BlockKey:
        """What identifies the KV of positions ``start:end`` for the prefix cache: the tokens,
        then the content hashes of the items placed there (same tokens, other image: another key),
        and whether the sequence was longer than the model's context switch (other KV)."""
        key = tuple(self.token_ids[start:end])
        if self.multimodal:
            key += tuple(r.item.content_hash for r in self.multimodal if r.offset < end and r.end > start)
        return key + (LONG_CONTEXT,) if self.long_context else key

    def chunk_end(self, start: int, end: int) -> int:
        """Where a prefill chunk from ``start`` that would end at ``end`` ends: before an item it
        would cut (with ``whole_items``), or after it where the chunk starts inside it; ``start``
        where neither fits (the chunk waits)."""
        if not self.whole_items:
            return end
        for r in self.multimodal:
            if r.offset < end < r.end:
                return r.offset if r.offset > start else start
        return end

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def at_limit(self) -> bool:
        """Whether the last token it may have is there (maybe still pending)."""
        return self.num_tokens >= self.max_num_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
