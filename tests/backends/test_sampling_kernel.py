"""The CUDA backend's sampling kernel draws the torch reference's tokens: same noise,
same rejection rounds (on the device ``XINFER_KERNEL_DEVICE`` picks; under the Triton
interpreter on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from xinfer.sampling import SampledRow, SamplingBatch, SamplingParams
from xinfer.torch_sampling import sample as reference
from xinfer_cuda.kernels.sampling import sample

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])

P = SamplingParams
ROWS = [
    SampledRow(P(temperature=0), 3, 0),
    SampledRow(P(temperature=1.0), 11, 5),
    SampledRow(P(temperature=0.8, top_p=0.95), 12, 9),
    SampledRow(P(temperature=0.7, top_p=0.3), 2**40 + 5, 17),
    SampledRow(P(temperature=1.1, top_k=7), -(2**63), 2**33),
    SampledRow(P(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02), 2**63 - 1, 1),
    SampledRow(P(temperature=1.5, min_p=0.2), 77, 123),
    SampledRow(P(temperature=0.5, top_k=1), 5, 5),
    SampledRow(P(temperature=0), 6, 6),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [97, 300])
def test_kernel_draws_the_reference_tokens(dtype, vocab):
    generator = torch.Generator().manual_seed(vocab)
    batch = SamplingBatch.of(ROWS)
    for trial in range(3):
        logits = (torch.randn(len(ROWS), vocab, generator=generator) * (1 + 2 * trial)).to(dtype)
        logits[:, 5] = float("-inf")  # a masked token (min_tokens)
        logits[-1, [3, 8]] = logits[-1].max() + 1  # a greedy tie: the first wins
        expected = reference(logits, batch)
        got = sample(logits.to(DEVICE), batch.to(DEVICE)).cpu()
        assert got.tolist() == expected.tolist()
        assert got[-1] == 3 and got[0] == logits[0].float().argmax()


def test_kernel_rows_past_the_logits_are_ignored_and_padding_is_greedy():
    batch = SamplingBatch.empty(6)
    batch.write(ROWS[1:3])  # rows 2.. are greedy padding
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    got = sample(logits.to(DEVICE), batch.to(DEVICE)).cpu()
    assert got.tolist() == reference(logits, batch).tolist()
    assert got[2:].tolist() == logits[2:].argmax(-1).tolist()
