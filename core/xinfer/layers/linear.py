"""Linear layers. ``MergedLinear`` stores several checkpoint projections as one
matrix (q/k/v, gate/up) so that one GEMM serves them all."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from xinfer import ops


class Linear(nn.Module):
    """``x @ weight.T + bias``; the weight may be quantized (:class:`xinfer.quant.QuantizedTensor`)."""

    quantized_weights: ClassVar[tuple[str, ...]] = ("weight",)  # the parameters that may be quantized

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Outputs of the checkpoint's projections ``shards`` stacked in that order.

    A checkpoint tensor of one shard is loaded with ``load_shard(name, tensor)``.
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shards.values()), bias)
        self.shard_sizes = dict(shards)

    def split(self, y: Tensor) -> tuple[Tensor, ...]:
        return y.split(list(self.shard_sizes.values()), dim=-1)

    def shard_offset(self, shard: str) -> tuple[int, int]:
        offset = 0
        for name, size in self.shard_sizes.items():
            if name == shard:
                return offset, size
            offset += size
        raise KeyError(shard)
