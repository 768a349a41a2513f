"""Recurrent-state slots: one per running sequence, held from its first step to its end
(or preemption), and snapshots of states for the prefix cache.

A snapshot is the state of every recurrent layer after a sequence's first N tokens (N a
block boundary), copied into a slot no sequence holds and known by the hash of the
prefix's last block. Slots no sequence holds are reused oldest first, so snapshots are
evicted least recently used, as cached blocks are; a slot given back without a snapshot
is reused before any snapshot.

A copy between slots is a device copy enqueued when the host decides it: the step in
flight was launched before it and the next step after, so the host's order is the device's
(under tensor parallelism, the other ranks make it before their next forward:
:meth:`xinfer.engine.runner.ModelRunner.copy_state_slot`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch import Tensor

SlotCopy = Callable[[int, int], None]  # (source, target)


@torch.no_grad()
def copy_slots(caches: list[dict[str, Tensor]], copies: Iterable[tuple[int, int]]) -> None:
    """Each ``(source, target)`` of ``copies`` in turn: slot ``target`` of every state tensor of ``caches`` (each
    recurrent layer's, [slots, ...]) takes slot ``source``'s value."""
    for source, target in copies:
        for cache in caches:
            for state in cache.values():
                state[target].copy_(state[source])


class StatePool:
    def __init__(self, num_slots: int, num_snapshots: int = 0, copy: SlotCopy | None = None):
        """``num_slots`` for sequences and ``num_snapshots`` more; ``copy`` copies one slot's
        state into another (over every recurrent layer)."""
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.copy = copy
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_slots + num_snapshots))
        self.snapshots: dict[int, int] = {}  # prefix hash -> slot
        self.hash_of: dict[int, int] = {}  # slot -> prefix hash

    @property
    def num_free(self) -> int:
        """Slots a sequence may still take."""
        return self.num_slots - self.num_held

    @property
    def num_held(self) -> int:
        return self.num_slots + self.num_snapshots - len(self.free)

    @property
    def usage(self) -> float:
        return self.num_held / self.num_slots

    def acquire(self) -> int:
        slot, _ = self.free.popitem(last=False)
        self._forget(slot)
        return slot

    def release(self, slot: int) -> None:
        self.free[slot] = None
        self.free.move_to_end(slot, last=False)  # holds no snapshot: the first to reuse

    # ---- snapshots -----------------------------------------------------------------

    def snapshot(self, prefix_hash: int) -> int | None:
        """The slot holding the state after the prefix ``prefix_hash``, now the most recently used."""
        slot = self.snapshots.get(prefix_hash)
        if slot is not None:
            self.free.move_to_end(slot)
        return slot

    def restore(self, snapshot: int) -> int:
        """A slot for a sequence, holding the state of slot ``snapshot``."""
        slot = self.acquire()  # the snapshot itself, where it was the only free slot
        self._copy(snapshot, slot)
        return slot

    def take(self, slot: int, prefix_hash: int) -> None:
        """Snapshot sequence slot ``slot``, the state after the prefix ``prefix_hash``
        (unless one is there already or every slot is held)."""
        if self.snapshot(prefix_hash) is not None or not self.free:
            return
        target, _ = self.free.popitem(last=False)
        self._forget(target)
        self._copy(slot, target)
        self.free[target] = None
        self.snapshots[prefix_hash], self.hash_of[target] = target, prefix_hash

    def forget_snapshots(self) -> None:
        for slot in list(self.hash_of):
            self._forget(slot)

    def _forget(self, slot: int) -> None:
        prefix_hash = self.hash_of.pop(slot, None)
        if prefix_hash is not None:
            del self.snapshots[prefix_hash]

    def _copy(self, source: int, target: int) -> None:
        if source != target and self.copy is not None:
            self.copy(source, target)
