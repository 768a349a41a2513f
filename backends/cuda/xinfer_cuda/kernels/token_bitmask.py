"""Grammar masks on the logits (:meth:`xinfer.ops.Ops.apply_token_bitmask`): one launch
for all the constrained rows, each program a block of one row's tokens, reading one
int32 word of the row's bitmask per 32 tokens and writing ``-inf`` where its bit is 0."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096


@triton.jit
def _apply_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, vocab, words,
                  BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    word = tokens // 32
    bits = tl.load(bitmask_ptr + i * bitmask_stride + word, mask=in_vocab & (word < words), other=0)
    allowed = ((bits >> (tokens % 32)) & 1) != 0
    row = tl.load(rows_ptr + i)
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
    num_rows, vocab = bitmask.shape[0], logits.shape[1]
    if num_rows == 0:
        return
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1
    grid = (num_rows, triton.cdiv(vocab, BLOCK))
    _apply_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab, bitmask.shape[1],
                        BLOCK=BLOCK)  # fmt: skip
