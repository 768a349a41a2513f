"""One page group's blocks: reference counts, a prefix cache, and the blocks a sliding
window no longer sees given back.

A full block is known by the hash chain of its tokens: ``hash(parent_hash, tokens)``,
computed once per sequence (:mod:`xinfer.cache.manager`) and the same in every group. A
freed block keeps its hash (and entries) until it is handed out again, so a later
request with the same prefix picks it up. Free blocks are reused oldest first.

With a window W, a query at position p reads only positions after p - W: once a
sequence's next token is past a block's reach, :meth:`BlockPool.trim` gives the block
back (its table entry becomes :data:`NO_BLOCK`), and a prefix-cache hit needs only the
blocks the next token reaches.

With a recent window (quantized caches), the pool is given its allocation of shadow
blocks (:class:`xinfer.cache.recent_window.RecentWindow`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xinfer.cache.recent_window import RecentWindow

NO_BLOCK = -1
"""A table entry whose block is out of the window's reach (given back), or a block without a shadow."""

BlockKey = tuple[int | str, ...]
"""What identifies a full block's KV (:meth:`xinfer.engine.sequence.Sequence.block_key`)."""


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: BlockKey = ()  # its key: the tokens, the content hashes of images among them, a long-context mark


@dataclass
class PageTable:
    """One sequence's blocks in one page group, and their shadows (recent window). Entries are
    never rewritten in place: a step prepared before a trim may still read the lists, so
    trimming and releasing replace them (allocation only appends)."""

    blocks: list[int] = field(default_factory=list)
    shadows: list[int] = field(default_factory=list)


class BlockPool:
    def __init__(
        self, num_blocks: int, block_size: int, window: int | None = None, recent_window: RecentWindow | None = None
    ):
        self.block_size = block_size
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.recent_window = recent_window

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Share of blocks held by sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed(self, position: int) -> int:
        """The first block a query at ``position`` reads."""
        return 0 if self.window is None else max(0, position - self.window + 1) // self.block_size

    # ---- prefix cache ------------------------------------------------------------

    def cached_block(self, block_hash: int, tokens: BlockKey) -> int | None:
        block_id = self.cached.get(block_hash)
        return block_id if block_id is not None and self.blocks[block_id].token_ids == tokens else None

    def serves(self, found: list[int | None], num_blocks: int) -> bool:
        """Whether the cached blocks ``found`` (per prompt block, None: not cached) let a
        sequence start computing after its first ``num_blocks`` blocks."""
        needed = range(self.first_needed(num_blocks * self.block_size), num_blocks)
        if any(found[i] is None for i in needed):
            return False
        return self.recent_window is None or self.recent_window.serves(found, needed)

    def attach(self, table: PageTable, found: list[int | None], num_blocks: int) -> None:
        """Give ``table`` the cached blocks of its first ``num_blocks`` that it needs
        (:meth:`serves` said it can)."""
        assert not table.blocks
        first = self.first_needed(num_blocks * self.block_size)
        for index in range(num_blocks):
            block_id = found[index] if index >= first else None
            if block_id is not None:
                self._take(block_id)
            table.blocks.append(NO_BLOCK if block_id is None else block_id)
        if self.recent_window is not None:
            self.recent_window.attach(table)

    def commit(
        self, table: PageTable, hashes: list[int], block_key: Callable[[int, int], BlockKey], first: int
    ) -> None:
        """Register ``table``'s blocks ``first`` to ``len(hashes)`` (full of computed
        tokens, whose hash chain is ``hashes``) in the prefix cache; ``block_key(start, end)``
        is what identifies positions ``start:end`` (:meth:`Sequence.block_key`)."""
        for index in range(first, len(hashes)):
            if table.blocks[index] == NO_BLOCK:
                continue
            block = self.blocks[table.blocks[index]]
            if hashes[index] not in self.cached:
                start = index * self.block_size
                block.hash, block.token_ids = hashes[index], block_key(start, start + self.block_size)
                self.cached[hashes[index]] = block.id

    def forget_free(self) -> None:
        """Drop the prefix-cache entries of the blocks no sequence holds."""
        for block_id in self.free:
            self._forget(self.blocks[block_id])

    # ---- allocation --------------------------------------------------------------

    def can_allocate(self, table: PageTable, num_tokens: int) -> bool:
        missing = self.blocks_needed(num_tokens) - len(table.blocks)
        if missing > self.num_free_blocks:
            return False
        return self.recent_window is None or self.recent_window.can_take(missing, self.blocks)

    def allocate(self, table: PageTable, num_tokens: int) -> None:
        """Make ``table`` cover ``num_tokens`` slots (:meth:`can_allocate` said it can)."""
        for _ in range(self.blocks_needed(num_tokens) - len(table.blocks)):
            block_id, _ = self.free.popitem(last=False)
            self._forget(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            table.blocks.append(block_id)
            if self.recent_window is not None:
                reclaimed = self.recent_window.take(table, block_id, self.free)
                if reclaimed is not None:
                    self._forget(self.blocks[reclaimed])  # no longer a prefix-cache hit without its sinks

    def trim(self, table: PageTable, num_computed: int) -> None:
        """Give back what the next token (at ``num_computed``) no longer reads: blocks out
        of the window's reach (and what the recent window no longer reads)."""
        out_of_reach = min(self.first_needed(num_computed), len(table.blocks))
        if out_of_reach > 0 and table.blocks[out_of_reach - 1] != NO_BLOCK:
            table.blocks, table.shadows = list(table.blocks), list(table.shadows)  # a prepared step may hold the old
            for index in range(out_of_reach - 1, -1, -1):
                if table.blocks[index] == NO_BLOCK:
                    break  # given back before, or never attached
                self._release(table, index)
                table.blocks[index] = NO_BLOCK
                if table.shadows:
                    table.shadows[index] = NO_BLOCK
        if self.recent_window is not None:
            self.recent_window.trim(table, num_computed)

    def release(self, table: PageTable) -> None:
        for index in reversed(range(len(table.blocks))):
            if table.blocks[index] != NO_BLOCK:
                self._release(table, index)
        table.blocks, table.shadows = [], []

    def _release(self, table: PageTable, index: int) -> None:
        block = self.blocks[table.blocks[index]]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block.id] = None
        keeps_sinks = index == 0 and (block.ref_count > 0 or block.hash is not None)
        if self.recent_window is not None and table.shadows[index] >= 0 and not keeps_sinks:
            self.recent_window.release(block.id)

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.cached.get(block.hash) == block.id:
            del self.cached[block.hash]
        block.hash, block.token_ids = None, ()
        if self.recent_window is not None:
            self.recent_window.release(block.id)
