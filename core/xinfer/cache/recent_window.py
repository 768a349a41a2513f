"""The recent window R of a quantized cache, as a block pool allocates it.

A block a sequence computes gets a shadow: an exact copy of its entries, which attention
reads for keys within R of a query. The shadow goes back once the block is more than R
behind the sequence's next token, except block 0's, which stays with the block (the
sinks every later query reads exact), also while the block is cached. A table's
``shadows`` name only the shadows of blocks its sequence computed and block 0's, so what
it reads exact does not depend on other sequences; a cached block 0 whose shadow was
reclaimed is no longer a prefix-cache hit. See docs/kv-cache.md.
"""

from __future__ import annotations

from collections.abc import Iterable

from xinfer.cache.block_pool import NO_BLOCK, Block, PageTable


class RecentWindow:
    """``num_shadows`` shadow blocks of ``block_size`` tokens for a window of ``window`` positions."""

    def __init__(self, num_shadows: int, window: int, block_size: int):
        self.window = window
        self.block_size = block_size
        self.free = list(range(num_shadows))
        self.shadow_of: dict[int, int] = {}  # block id -> its shadow

    def serves(self, found: list[int | None], needed: range) -> bool:
        """Whether a prefix-cache hit on the blocks ``found`` keeps its sinks exact."""
        return 0 not in needed or found[0] in self.shadow_of

    def attach(self, table: PageTable) -> None:
        """The shadows of ``table``'s cached blocks: block 0's only (the sinks)."""
        table.shadows = [NO_BLOCK] * len(table.blocks)
        if table.blocks and table.blocks[0] != NO_BLOCK:
            table.shadows[0] = self.shadow_of[table.blocks[0]]

    def can_take(self, count: int, blocks: list[Block]) -> bool:
        """Whether ``count`` shadows are free, or held by cached blocks no sequence holds."""
        if count <= len(self.free):
            return True
        return count <= len(self.free) + sum(blocks[b].ref_count == 0 for b in self.shadow_of)

    def take(self, table: PageTable, block_id: int, free_blocks: Iterable[int]) -> int | None:
        """A shadow for ``table``'s new block ``block_id``. With none free, the oldest of
        ``free_blocks`` that keeps one gives it up: returns that block."""
        reclaimed = None
        if not self.free:
            reclaimed = next(b for b in free_blocks if b in self.shadow_of)
            self.release(reclaimed)
        self.shadow_of[block_id] = self.free.pop()
        table.shadows.append(self.shadow_of[block_id])
        return reclaimed

    def trim(self, table: PageTable, num_computed: int) -> None:
        """Give back the shadows R or more behind the next token (at ``num_computed``),
        never block 0's while the block stays."""
        done = max(0, num_computed - self.window + 1) // self.block_size  # blocks now out of reach
        last = min(done, len(table.shadows)) - 1
        if last <= 0 or table.shadows[last] < 0:
            return
        table.shadows = list(table.shadows)  # a prepared step may hold the old list
        for index in range(last, 0, -1):
            if table.shadows[index] < 0:
                break  # trimmed before, or a prefix-cache hit
            self.release(table.blocks[index])
            table.shadows[index] = NO_BLOCK

    def release(self, block_id: int) -> None:
        """Give back ``block_id``'s shadow, if it has one."""
        shadow = self.shadow_of.pop(block_id, None)
        if shadow is not None:
            self.free.append(shadow)
