"""The CUDA backend's grammar-mask kernel against the torch reference op (on the device
``XINFER_KERNEL_DEVICE`` picks; under the Triton interpreter on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels.token_bitmask import apply_token_bitmask

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "words"), [(5000, 157), (100, 2), (4096 + 33, 130)])
def test_kernel_masks_what_the_reference_masks(dtype, vocab, words):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=generator).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31, (3, words), generator=generator, dtype=torch.int64).to(torch.int32)
    bitmask[1] = -1  # every token allowed (as far as the bitmask reaches)
    rows = torch.tensor([4, 0, 2])
    expected = logits.clone()
    TorchOps().apply_token_bitmask(expected, bitmask, rows)
    got = logits.to(DEVICE)
    apply_token_bitmask(got, bitmask.to(DEVICE), rows.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
