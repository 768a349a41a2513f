"""The tensor-parallel group a model is built for: this rank's place in it and the collectives
its layers run. Layers read the group in use when they are built (:func:`building_for`) and keep
it, so engines of different sizes can live in one process.

A rank holds a :class:`Part` of each split tensor: the ``index``-th of ``count`` equal parts of
its rows (or of each block of rows, for tensors made of blocks split alike); of a checkpoint tensor,
the :class:`Slice` it keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


class WorkerFailed(RuntimeError):
    """A rank of the tensor-parallel group died or stopped answering: the engine cannot step."""


@dataclass(frozen=True)
class Slice:
    """Of a tensor, the rows ``ranges`` (each ``[start, stop)``) along ``dim``, in order, then zero rows up
    to ``length`` where given (a part padded past the tensor's end). A rank declares the slice of a checkpoint
    tensor it keeps, and the loader reads only that (:class:`xinfer.loading.stored.StoredTensor`)."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    length: int | None = None

    def of(self, tensor: Tensor) -> Tensor:
        """This slice of a tensor in memory."""
        return self.padded(self.pieces(tensor.narrow))

    def pieces(self, rows: Callable[[int, int, int], Tensor]) -> list[Tensor]:
        """The ranges' rows, each from ``rows(dim, start, count)``."""
        return [rows(self.dim, start, stop - start) for start, stop in self.ranges]

    def padded(self, pieces: list[Tensor]) -> Tensor:
        """``pieces`` joined along ``dim``, then zero rows up to ``length``."""
        part = pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)
        missing = (self.length or 0) - part.shape[self.dim]
        if missing <= 0:
            return part
        shape = list(part.shape)
        shape[self.dim] = missing
        return torch.cat([part, part.new_zeros(shape)], self.dim)


@dataclass(frozen=True)
class Part:
    """Part ``index`` of ``count`` equal parts; with ``blocks`` (their sizes), that part of each block."""

    count: int = 1
    index: int = 0
    blocks: tuple[int, ...] | None = None

    @property
    def whole(self) -> bool:
        return self.count == 1

    def size(self, total: int) -> int:
        return total // self.count

    def ranges(self, total: int, unit: int = 1, offset: int = 0) -> tuple[tuple[int, int], ...]:
        """This part's ``[start, stop)`` of ``total`` rows (of each block), counted in groups of ``unit``
        rows (a head's), from row ``offset``."""
        found, start = [], 0
        for block in self.blocks or (total,):
            first = start + self.index * self.size(block)
            found.append((offset + first * unit, offset + (first + self.size(block)) * unit))
            start += block
        return tuple(found)

    def slice(self, total: int, dim: int = 0, unit: int = 1) -> Slice:
        """This part of a tensor of ``total`` rows (groups of ``unit`` rows) along ``dim``."""
        return Slice(dim, self.ranges(total, unit))

    def of(self, tensor: Tensor, dim: int = 0) -> Tensor:
        """This part of ``tensor`` along ``dim``."""
        return tensor if self.whole else self.slice(tensor.shape[dim], dim).of(tensor)


WHOLE = Part()


@dataclass(frozen=True)
class TensorParallel:
    """``size`` ranks splitting one model; ``group`` runs the layers' collectives (the device's
    backend: NCCL on CUDA, gloo on the CPU), ``control`` the host messages (gloo)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None

    @property
    def first(self) -> bool:
        return self.rank == 0

    def split(self, total: int, what: str, blocks: tuple[int, ...] | None = None) -> Part:
        """An even split of ``total`` rows (of each of ``blocks``) over the ranks."""
        for size in blocks or (total,):
            if size % self.size:
                raise ValueError(f"tensor parallel {self.size}: {what} ({size}) does not split evenly over the ranks")
        return Part(self.size, self.rank, blocks)

    def heads(self, num_heads: int, what: str = "heads") -> Part:
        """Heads over the ranks: an even split, or with fewer heads than ranks each head on
        ``size / num_heads`` ranks (KV heads replicated)."""
        if num_heads % self.size == 0:
            return Part(self.size, self.rank)
        if self.size % num_heads == 0:
            return Part(num_heads, self.rank * num_heads // self.size)
        raise ValueError(
            f"tensor parallel {self.size}: {num_heads} {what} split neither evenly over the ranks nor the ranks "
            f"over them: choose a tensor_parallel_size that divides or is a multiple of {num_heads}"
        )

    def all_reduce(self, x: Tensor) -> Tensor:
        """The sum of ``x`` over the ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_columns(self, x: Tensor) -> Tensor:
        """The ranks' ``x`` [N, C] side by side [N, size * C] on the first rank; zeros elsewhere (only
        the first rank samples)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.first else None
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else x.new_zeros(x.shape[0], self.size * x.shape[1])

    def min_over_ranks(self, values: list[int]) -> list[int]:
        """Each of ``values`` at its least over the ranks (a plan every rank can hold)."""
        if self.size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return tensor.tolist()


SINGLE = TensorParallel()
_building: ContextVar[TensorParallel] = ContextVar("tensor_parallel", default=SINGLE)


@contextlib.contextmanager
def building_for(tp: TensorParallel) -> Iterator[None]:
    """Layers built inside take their part of ``tp``."""
    token = _building.set(tp)
    try:
        yield
    finally:
        _building.reset(token)


def current() -> TensorParallel:
    """The group the layers being built belong to (one rank outside :func:`building_for`)."""
    return _building.get()
