"""The int8 tensor-core dot over GGUF weights in planes (:mod:`xinfer_cuda.kernels.plane_i8_dot`), on the device
``XINFER_KERNEL_DEVICE`` picks (under the Triton interpreter on "cpu"): the activations quantized per block of 32
as llama.cpp's q8 blocks are, and the product against ``gguf.quants.dequantize`` of the file's bytes in float64
(the codes' part with the quantized activations, each block's constant with the exact ones), and against the
plain product within what rounding the activations to 8 bits costs."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from tests.backends.test_gguf_kernels import check, reference_weight
from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.kernels.gguf_planes import LAYOUTS, from_planes, to_planes
from xinfer_cuda.kernels.gguf_planes import planes as plane_views
from xinfer_cuda.kernels.plane_i8_dot import PlaneI8DotConfig, plane_i8_dot, quantize_blocks

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def test_activations_are_quantized_per_block_of_32_as_llama_cpps_q8_blocks():
    x = torch.randn(3, 96, device=DEVICE) * torch.tensor([1.0, 1e-3, 30.0], device=DEVICE)[:, None]
    x[1, 32:64] = 0.0  # an all-zero block
    q, d, s = (t.cpu() for t in quantize_blocks(x))
    blocks = x.cpu().reshape(3, 3, 32)
    scale = blocks.abs().amax(-1) / 127
    ratio = blocks / torch.where(scale == 0, 1.0, scale)[..., None]
    assert torch.allclose(d, scale, rtol=1e-6, atol=0)
    assert torch.equal(q.reshape(3, 3, 32), (torch.sign(ratio) * torch.floor(ratio.abs() + 0.5)).to(torch.int8))
    assert torch.allclose(s, blocks.sum(-1), rtol=1e-5, atol=1e-6)
    assert (q.reshape(3, 3, 32)[1, 1] == 0).all() and d[1, 1] == 0


def block_constants(planes: torch.Tensor, name: str, n: int, k: int) -> torch.Tensor:
    """Each (row, block)'s part of the weight its codes do not carry: the weight with every code at the value the
    kernel takes as 0 (Q8_0's 128, Q6_K's 32, Q5_0's 16, Q4_0's 8, the affine types' 0)."""
    zeroed = planes.clone()
    views = plane_views(zeroed, LAYOUTS[name], n, k)
    views[0].fill_({"Q8_0": 0x80, "Q4_0": 0x88}.get(name, 0))
    if LAYOUTS[name].high_bits:  # Q6_K's 2 high bits a code: 32 = 0b10 << 4; Q5_0's one: 16 = 1 << 4
        views[1].fill_({"Q6_K": 0xAA, "Q5_0": 0xFF}.get(name, 0))
    return reference_weight(from_planes(zeroed.cpu(), LAYOUTS[name], n, k), name).double()


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_int8_dot_is_the_weight_times_the_quantized_activations(name):
    """5 rows of x in a 16-row tile, 20 rows of the weight over two tiles of 16, 3 tiles of a row (with a bias), a half
    tile a loop step and a whole one, the weight's rows as the MMA's first operand; then split along K in 3 programs,
    their partial sums and the bias added by the second kernel."""
    n, k = 20, 3 * LAYOUTS[name].tile
    packed = random_packed(n, k, FORMATS[name], device=DEVICE)
    planes = to_planes(packed, LAYOUTS[name])
    x, bias = torch.randn(5, k, device=DEVICE).to(DTYPE), torch.randn(n, device=DEVICE).to(DTYPE)
    want, plain = (product + bias.cpu().double() for product in int8_products(x, packed, planes, name))
    configs = (
        PlaneI8DotConfig(16, 16, 4, 2),
        PlaneI8DotConfig(16, 16, 4, 2, halves=2),
        PlaneI8DotConfig(16, 16, 4, 2, weight_rows_first=True),
        PlaneI8DotConfig(16, 16, 4, 2, split=3),
    )
    for config in configs:
        check_int8(plane_i8_dot(x, planes, name, n, bias, config), want, plain)


def int8_products(x: torch.Tensor, packed: torch.Tensor, planes: torch.Tensor, name: str):
    """``x`` times the weight as the int8 dot computes it (the codes' part with the activations quantized, each
    block's constant with the exact ones), and the plain product, both in float64 on the CPU."""
    (m, k), n = x.shape, packed.shape[0]
    weight = reference_weight(packed, name).double()
    constants = block_constants(planes, name, n, k)
    q, d, _ = (t.cpu() for t in quantize_blocks(x))
    x_quantized = (q.double().reshape(m, -1, 32) * d.double()[..., None]).reshape(m, k)
    exact_x = x.cpu().double()
    return x_quantized @ (weight - constants).T + exact_x @ constants.T, exact_x @ weight.T


def check_int8(out: torch.Tensor, want: torch.Tensor, plain: torch.Tensor) -> None:
    check(out, want, out.dtype)
    assert ((out.cpu().double() - plain).norm() / plain.norm()) < 2e-2, "8-bit activations cost more than 2 %"
