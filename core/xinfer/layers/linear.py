"""Linear layers. ``MergedLinear`` stores several checkpoint projections as one
matrix (q/k/v, gate/up) so that one GEMM serves them all.

Under tensor parallelism (:mod:`xinfer.distributed`) a ``Linear`` is whole on every rank; a
:class:`ColumnLinear` (and a ``MergedLinear`` given ``parts``) holds this rank's part of the
output rows and computes only those; a :class:`RowLinear` holds its part of the input columns
and sums its output over the ranks. Each names the slice of a checkpoint tensor it keeps
(``rank_slice``), which is all the loader reads of it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import ClassVar

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.distributed.group import WHOLE, Part, Slice, current


class Linear(nn.Module):
    """``x @ weight.T + bias``; the weight may be quantized (:class:`xinfer.quant.QuantizedTensor`)."""

    quantized_weights: ClassVar[tuple[str, ...]] = ("weight",)  # the parameters that may be quantized

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


class FloatLinear(Linear):
    """A linear whose few bytes stay float, read as such (a gate, an indexer's head weights): a packed checkpoint's
    weight is dequantized once at load, and ``--isq`` never packs it."""

    quantized_weights: ClassVar[tuple[str, ...]] = ()


class ColumnLinear(Linear):
    """This rank's ``part`` of the output rows (by default an even split over the ranks)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, part: Part | None = None):
        self.part = part or current().split(out_features, f"a projection's {out_features} outputs")
        super().__init__(in_features, self.part.size(out_features), bias)

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        return self.part.slice(shape[0])


class RowLinear(Linear):
    """This rank's ``part`` of the input columns; the output summed over the ranks, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, part: Part | None = None):
        self.tp = current()
        self.part = part or self.tp.split(in_features, f"a projection's {in_features} inputs")
        super().__init__(self.part.size(in_features), out_features, bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(ops.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        return WHOLE.slice(shape[0]) if name == "bias" else self.part.slice(shape[-1], dim=-1)


class MergedLinear(Linear):
    """Outputs of the checkpoint's projections ``shards`` (their full sizes) stacked in that order;
    of each, this rank's part where ``parts`` names one (whole elsewhere). ``bias``: every shard has
    one (True), none (False), or the shards named (the others' rows of the bias stay zero).
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool | Collection[str] = False,
                 parts: dict[str, Part] | None = None):  # fmt: skip
        self.parts = {name: (parts or {}).get(name, WHOLE) for name in shards}
        self.full_sizes = dict(shards)
        self.shard_sizes = {name: self.parts[name].size(size) for name, size in shards.items()}
        self.biased = tuple(name for name in shards if bias is True or name in (bias or ()))
        super().__init__(in_features, sum(self.shard_sizes.values()), bool(self.biased))
        if self.bias is not None and len(self.biased) < len(shards):
            nn.init.zeros_(self.bias)

    def shards_of(self, leaf: str) -> tuple[str, ...]:
        """The shards the checkpoint holds parameter ``leaf`` (weight, bias) of."""
        return self.biased if leaf == "bias" else tuple(self.shard_sizes)

    def split(self, y: Tensor) -> tuple[Tensor, ...]:
        return y.split_with_sizes(list(self.shard_sizes.values()), dim=-1)  # (Tensor.split: two Python calls more)

    def shard_offset(self, shard: str) -> tuple[int, int]:
        offset = 0
        for name, size in self.shard_sizes.items():
            if name == shard:
                return offset, size
            offset += size
        raise KeyError(shard)

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        """Of one shard's tensor, or of the checkpoint's merged one (every shard's), this rank's part."""
        if shard is not None:
            return self.parts[shard].slice(shape[0])
        ranges: list[tuple[int, int]] = []
        offset = 0
        for shard_name, size in self.full_sizes.items():
            ranges += self.parts[shard_name].ranges(size, offset=offset)
            offset += size
        return Slice(0, tuple(ranges))
