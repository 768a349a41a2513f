"""A sequence's cache across kinds: a page table in each page group's pool (full
attention, each sliding window) and, for models with recurrent layers, a state slot.

Allocation is all or nothing across pools. A prefix-cache hit is the longest prefix
that every pool can serve (:meth:`BlockPool.serves`): the whole prefix for full
attention, the blocks its window still reaches for a sliding layer; with recurrent
layers, also one whose state was snapshotted (:class:`StatePool`), which the sequence's
slot starts from. Snapshots are taken where a prefill chunk ends, and the scheduler ends
chunks at the points :meth:`CacheManager.next_snapshot` names: every
``snapshot_interval`` tokens, the prompt's last block boundary (a later turn of the
conversation starts with it), and the end of a prefix the pools served but no snapshot
did (another sequence shares it, so the next ones hit there).
"""

from __future__ import annotations

from xinfer.cache.block_pool import BlockPool, PageTable
from xinfer.cache.state_pool import StatePool
from xinfer.engine.sequence import Sequence


class CacheManager:
    def __init__(
        self,
        pools: list[BlockPool],
        enable_prefix_caching: bool = True,
        states: StatePool | None = None,
        snapshot_interval: int = 1024,
        block_size: int = 16,
    ):
        """``block_size``: the prefix cache's unit where no pool has blocks (every layer recurrent)."""
        assert pools or states, "a model caches something"
        self.pools = pools
        self.states = states
        self.block_size = pools[0].block_size if pools else block_size
        self.snapshot_interval = max(1, snapshot_interval // self.block_size) * self.block_size
        self.enable_prefix_caching = enable_prefix_caching and (states is None or states.num_snapshots > 0)
        self.trims = any(pool.window is not None or pool.recent_window is not None for pool in pools)
        self.queries = 0  # prefix-cache lookups, in blocks
        self.hits = 0

    @property
    def usage(self) -> float:
        """Share of the scarcest pool held by sequences."""
        return max([pool.usage for pool in self.pools] + ([self.states.usage] if self.states else []))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix that no sequence holds (blocks in use keep theirs) and every state snapshot."""
        for pool in self.pools:
            pool.forget_free()
        if self.states is not None:
            self.states.forget_snapshots()

    def tables(self, seq: Sequence) -> list[PageTable]:
        if len(seq.pages) != len(self.pools):
            seq.pages = [PageTable() for _ in self.pools]
        return seq.pages

    def holds(self, seq: Sequence) -> bool:
        """Whether ``seq`` has blocks or a state slot (it was matched or allocated)."""
        return seq.state_slot is not None or any(table.blocks for table in seq.pages)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks (and restore a state snapshot) for the longest known prefix
        of ``seq``; returns its length.

        At least one prompt token is left to compute, so the step that finishes the
        prompt still produces logits.
        """
        tables = self.tables(seq)
        assert not any(table.blocks for table in tables)
        if not self.enable_prefix_caching:
            return 0
        hashes, chunks, parent = [], [], None
        for start in range(0, seq.num_tokens - self.block_size, self.block_size):
            chunk = seq.block_key(start, start + self.block_size)
            parent = hash((parent, chunk))
            hashes.append(parent)
            chunks.append(chunk)
        found = [[pool.cached_block(h, chunk) for h, chunk in zip(hashes, chunks)] for pool in self.pools]
        served = len(hashes)
        while served and not self._pools_serve(found, served):
            served -= 1
        num_blocks = served
        if self.states is not None:
            while num_blocks and not (hashes[num_blocks - 1] in self.states.snapshots and
                                      self._pools_serve(found, num_blocks)):  # fmt: skip
                num_blocks -= 1
            if not self.states.num_free:
                num_blocks = 0
            seq.state_boundary = served * self.block_size if served > num_blocks else 0
        self.queries += len(hashes)
        self.hits += num_blocks
        for pool, f, table in zip(self.pools, found, tables):
            pool.attach(table, f, num_blocks)
        seq.block_hashes = hashes[:num_blocks]
        if self.states is not None and num_blocks:
            snapshot = self.states.snapshot(hashes[num_blocks - 1])
            assert snapshot is not None
            seq.state_slot = self.states.restore(snapshot)
        return num_blocks * self.block_size

    def _pools_serve(self, found: list[list[int | None]], num_blocks: int) -> bool:
        return all(pool.serves(f, num_blocks) for pool, f in zip(self.pools, found))

    def next_snapshot(self, seq: Sequence) -> int:
        """Where ``seq``'s next prefill chunk ends to snapshot its state: the first snapshot
        point past its computed tokens, else its length."""
        if self.states is None or not self.enable_prefix_caching:
            return seq.num_tokens
        computed = seq.num_computed_tokens
        points = ((computed // self.snapshot_interval + 1) * self.snapshot_interval, seq.state_boundary,
                  self._last_boundary(seq))  # fmt: skip
        return min([point for point in points if computed < point < seq.num_tokens], default=seq.num_tokens)

    def _is_snapshot_point(self, seq: Sequence, position: int) -> bool:
        if not 0 < position < seq.num_tokens:
            return False  # a decode step's, or none
        return position % self.snapshot_interval == 0 or position in (seq.state_boundary, self._last_boundary(seq))

    def _last_boundary(self, seq: Sequence) -> int:
        """The longest prefix a sequence with the same tokens can hit (one token is left to compute)."""
        return (seq.num_tokens - 1) // self.block_size * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Make ``seq``'s tables cover ``num_tokens`` slots, and give it a state slot;
        False (and nothing taken) where a pool ran out."""
        tables = self.tables(seq)
        if (seq.state_slot is not None or self.states is None) and all(
            len(table.blocks) * self.block_size >= num_tokens for table in tables
        ):
            return True  # most decode steps: the last block has room
        if not all(pool.can_allocate(table, num_tokens) for pool, table in zip(self.pools, tables)):
            return False
        if self.states is not None and seq.state_slot is None:
            if not self.states.num_free:
                return False
            seq.state_slot = self.states.acquire()
        for pool, table in zip(self.pools, tables):
            pool.allocate(table, num_tokens)
        return True

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed tokens in the prefix cache, and
        snapshot the state where the step ended at a snapshot point."""
        if not self.enable_prefix_caching:
            return
        first, full = len(seq.block_hashes), seq.num_computed_tokens // self.block_size
        if first == full and self.states is None:  # most decode steps fill no block
            return
        for index in range(first, full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            start = index * self.block_size
            seq.block_hashes.append(hash((parent, seq.block_key(start, start + self.block_size))))
        for pool, table in zip(self.pools, self.tables(seq)):
            pool.commit(table, seq.block_hashes, seq.block_key, first)
        if self.states is not None and self._is_snapshot_point(seq, seq.num_computed_tokens):
            assert seq.state_slot is not None
            self.states.take(seq.state_slot, seq.block_hashes[seq.num_computed_tokens // self.block_size - 1])

    def trim(self, seq: Sequence) -> None:
        """Give back what ``seq``'s next token no longer reads."""
        if not self.trims:
            return
        for pool, table in zip(self.pools, self.tables(seq)):
            pool.trim(table, seq.num_computed_tokens)

    def release(self, seq: Sequence) -> None:
        for pool, table in zip(self.pools, self.tables(seq)):
            pool.release(table)
        if self.states is not None and seq.state_slot is not None:
            self.states.release(seq.state_slot)
            seq.state_slot = None
        seq.block_hashes.clear()
