"""Paged KV blocks with reference counts and a prefix cache.

A full block is known by the hash chain of its tokens: ``hash(parent_hash, tokens)``.
A freed block keeps its hash (and KV) until it is handed out again, so a later
request with the same prefix picks it up. Free blocks are reused oldest first.

With a recent window W (quantized caches), a block a sequence computes gets a shadow:
an exact copy of its K/V, which attention reads for keys within W of a query. The
shadow goes back to the pool once the block is more than W behind the sequence's next
token (:meth:`BlockManager.trim`), except block 0's, which stays with the block (the
sinks every later query reads exact), also while the block is cached. A sequence's
``shadow_table`` names only the shadows of blocks it computed and block 0's, so what
it reads exact does not depend on other sequences; a cached block 0 whose shadow was
reclaimed is no longer a prefix-cache hit. See docs/kv-cache.md.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from xinfer.engine.sequence import Sequence


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, num_shadows: int = 0, window: int = 0
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.queries = 0  # prefix-cache lookups, in blocks
        self.hits = 0
        self.window = window
        self.free_shadows = list(range(num_shadows))
        self.shadow_of: dict[int, int] = {}  # block id -> its shadow

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Share of blocks held by running sequences."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks for the longest known prefix of ``seq``; returns its length.

        At least one prompt token is left to compute, so the step that finishes the
        prompt still produces logits.
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        parent = None
        for start in range(0, seq.num_tokens - 1 - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            block_hash = hash((parent, tokens))
            self.queries += 1
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            if self.window and start == 0 and block_id not in self.shadow_of:
                break  # its sinks are gone
            self.hits += 1
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(block_hash)
            if self.window:
                seq.shadow_table.append(self.shadow_of[block_id] if start == 0 else -1)
            parent = block_hash
        return len(seq.block_table) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq``'s block table cover ``num_tokens`` slots; False if blocks ran out."""
        missing = self.blocks_needed(num_tokens) - len(seq.block_table)
        if missing > self.num_free_blocks:
            return False
        short = self.window and missing > len(self.free_shadows)
        if short and missing > len(self.free_shadows) + len(self._reclaimable_shadows()):
            return False
        for _ in range(missing):
            block_id, _ = self.free.popitem(last=False)
            self._forget(self.blocks[block_id])
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)
            if self.window:
                self.shadow_of[block_id] = self._take_shadow()
                seq.shadow_table.append(self.shadow_of[block_id])
        return True

    def trim(self, seq: Sequence) -> None:
        """Return the shadows of ``seq``'s blocks that no later query reads exact: those
        whose last position is W or more before its next token (never block 0's)."""
        if not self.window:
            return
        done = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size  # blocks now out of reach
        for index in range(min(done, len(seq.shadow_table)) - 1, 0, -1):
            if seq.shadow_table[index] < 0:
                break  # trimmed before, or a prefix-cache hit
            self._release_shadow(seq.block_table[index])
            seq.shadow_table[index] = -1

    def release(self, seq: Sequence) -> None:
        for index, block_id in reversed(list(enumerate(seq.block_table))):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
            keeps_sinks = index == 0 and (block.ref_count > 0 or block.hash is not None)
            if self.window and seq.shadow_table[index] >= 0 and not keeps_sinks:
                self._release_shadow(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.shadow_table.clear()

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for index in range(len(seq.block_hashes), num_full):
            start = index * self.block_size
            tokens = tuple(seq.token_ids[start : start + self.block_size])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = hash((parent, tokens))
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_table[index]]
            if block_hash not in self.cached:
                block.hash, block.token_ids = block_hash, tokens
                self.cached[block_hash] = block.id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self.cached.get(block.hash) == block.id:
            del self.cached[block.hash]
        block.hash, block.token_ids = None, ()
        self._release_shadow(block.id)

    def _release_shadow(self, block_id: int) -> None:
        shadow = self.shadow_of.pop(block_id, None)
        if shadow is not None:
            self.free_shadows.append(shadow)

    def _reclaimable_shadows(self) -> list[int]:
        """Blocks no sequence holds that keep a shadow: cached first blocks."""
        return [b for b in self.shadow_of if self.blocks[b].ref_count == 0]

    def _take_shadow(self) -> int:
        if not self.free_shadows:
            oldest = next(b for b in self.free if b in self.shadow_of)
            self._forget(self.blocks[oldest])  # no longer a prefix-cache hit without its sinks
        return self.free_shadows.pop()
