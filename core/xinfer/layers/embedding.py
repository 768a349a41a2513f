from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xinfer import ops
from xinfer.quant import QuantizedTensor


class VocabEmbedding(nn.Module):
    """A table of token vectors; a quantized table dequantizes only the rows looked up."""

    quantized_weights: ClassVar[tuple[str, ...]] = ("weight",)
    looks_up_rows: ClassVar[bool] = True  # a backend repacking the table must keep rows readable

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.compute_dtype = self.weight.dtype

    def forward(self, input_ids: Tensor) -> Tensor:
        if isinstance(self.weight, QuantizedTensor):
            return self.weight.dequantize_rows(input_ids, self.compute_dtype)
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits, in the model dtype; soft-capped ones
    in fp32. Whoever needs fp32 converts: a greedy step's pick does not."""

    quantized_weights: ClassVar[tuple[str, ...]] = ("weight",)

    def __init__(self, vocab_size: int, dim: int, softcap: float | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))
        self.softcap = softcap

    def forward(self, hidden: Tensor) -> Tensor:
        logits = ops.linear(hidden, self.weight)
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits.float() / self.softcap)
        return logits
