"""Recurrent-state slots: one per running sequence, held from its first step to its end
(or preemption, after which it is recomputed from its first token)."""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_slots

    def acquire(self) -> int:
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.free.append(slot)
