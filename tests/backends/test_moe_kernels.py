"""The fused-MoE kernels against the plain-torch reference (``TorchOps.fused_moe``), on the
device ``XINFER_KERNEL_DEVICE`` picks (on "cpu" under the Triton interpreter; see
conftest.py and test_cuda_kernels.py for the tolerances' reasoning).

Routings are random with distinct experts per token; the step sizes cover the per-slot
path (T*k up to 32: decode) and the grouped one (prefill sizes, experts that get no
slot, blocks padded), with outputs poisoned with NaN first."""

from __future__ import annotations

import os

import pytest
import torch

from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import moe

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# (tokens, experts, top_k, hidden, intermediate)
SHAPES = [
    (1, 8, 2, 64, 48),
    (3, 16, 4, 64, 48),
    (4, 8, 8, 96, 40),
    (9, 64, 4, 64, 48),
    (37, 16, 4, 64, 48),
    (130, 8, 2, 80, 64),
]
if ON_GPU:
    SHAPES += [(1, 128, 8, 2048, 768), (512, 128, 8, 2048, 768)]  # Qwen3-30B-A3B: a decode and a prefill step


def routing(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator)
    return weights / weights.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
def test_fused_moe_matches_the_reference(shape, dtype, activation):
    tokens, experts, top_k, hidden, inter = shape
    generator = torch.Generator().manual_seed(tokens * 131 + experts)
    x = torch.randn(tokens, hidden, generator=generator)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=generator) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=generator) * inter**-0.5
    weights, ids = routing(tokens, experts, top_k, generator)
    expected = TorchOps().fused_moe(*(t.to(dtype).float() for t in (x, w13, w2)), weights, ids, activation)
    got = moe.fused_moe(*(t.to(DEVICE, dtype) for t in (x, w13, w2)), weights.to(DEVICE), ids.to(DEVICE), activation)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert got.isfinite().all()
    error = (got.cpu().double() - expected.double()).norm() / expected.double().norm()
    assert error <= TOL[dtype], f"relative error {error:.2e}"


def test_align_blocks_puts_every_slot_once_in_a_block_of_its_expert():
    generator = torch.Generator().manual_seed(0)
    _, ids = routing(37, 16, 4, generator)
    block_slots, block_experts = moe.align_blocks(ids.to(DEVICE), 16, block_m=16)
    block_slots, block_experts = block_slots.cpu().view(len(block_experts), 16), block_experts.cpu()
    flat = ids.flatten()
    real = block_slots[block_experts >= 0]
    assert sorted(real[real < flat.numel()].tolist()) == list(range(flat.numel()))
    for slots, expert in zip(block_slots, block_experts.tolist()):
        slots = slots[slots < flat.numel()]
        assert expert >= 0 or slots.numel() == 0
        assert (flat[slots.long()] == expert).all()
