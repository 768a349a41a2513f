"""Token embeddings and the LM head. Under tensor parallelism both split the vocabulary (padded to
a multiple of the ranks): a rank embeds the tokens of its rows, the sum over the ranks is the
embedding; a rank's logits are those of its rows, gathered on the first rank."""

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xinfer import ops
from xinfer.distributed.group import Slice, current
from xinfer.quant import QuantizedTensor


class _VocabRows(nn.Module):
    """``weight`` [this rank's rows of the padded vocabulary, dim]."""

    quantized_weights: ClassVar[tuple[str, ...]] = ("weight",)

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.tp, self.vocab_size = current(), vocab_size
        rows = -(-vocab_size // self.tp.size)
        self.start = self.tp.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        """This rank's rows of the vocabulary, zeros past its end."""
        rows = self.weight.shape[0]
        start, stop = min(self.start, shape[0]), min(self.start + rows, shape[0])
        return Slice(0, ((start, stop),), length=rows)


class VocabEmbedding(_VocabRows):
    """A table of token vectors; a quantized table dequantizes only the rows looked up."""

    looks_up_rows: ClassVar[bool] = True  # a backend repacking the table must keep rows readable

    def __init__(self, vocab_size: int, dim: int):
        super().__init__(vocab_size, dim)
        self.compute_dtype = self.weight.dtype

    def forward(self, input_ids: Tensor) -> Tensor:
        if isinstance(self.weight, QuantizedTensor):
            return self.weight.dequantize_rows(input_ids, self.compute_dtype)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * mine.unsqueeze(-1)
        return self.tp.all_reduce(out)


class LMHead(_VocabRows):
    """Projects hidden states to vocabulary logits, in the model dtype; soft-capped ones
    in fp32. Whoever needs fp32 converts: a greedy step's pick does not."""

    def __init__(self, vocab_size: int, dim: int, softcap: float | None = None):
        super().__init__(vocab_size, dim)
        self.softcap = softcap

    @classmethod
    def of(cls, config: Any, embedding: VocabEmbedding, softcap: float | None = None) -> "LMHead":
        """The head of a model of ``config``: with ``tie_word_embeddings``, ``embedding``'s table is its weight."""
        head = cls(config.vocab_size, config.hidden_size, softcap)
        if getattr(config, "tie_word_embeddings", False):
            head.weight = embedding.weight
        return head

    def forward(self, hidden: Tensor) -> Tensor:
        logits = ops.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.gather_columns(logits)[:, : self.vocab_size]
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits.float() / self.softcap)
        return logits
