"""The one-row int8 GEMV over GGUF weights in planes (:mod:`xinfer_cuda.kernels.plane_i8_gemv`), on the device
``XINFER_KERNEL_DEVICE`` picks (under the Triton interpreter on "cpu", where its byte permutes and ``dp4a`` are
shifts and masks; on a GPU they are PTX): the activations stored in the order it reads them, and its product against
``gguf.quants.dequantize`` of the file's bytes in float64 with the same quantized activations, and against the plain
product within what rounding the activations to 8 bits costs (:func:`check_int8`)."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

from tests.backends.test_plane_i8_dot import check_int8, int8_products
from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.kernels.gguf_planes import LAYOUTS, to_planes
from xinfer_cuda.kernels.norm import rms_norm
from xinfer_cuda.kernels.plane_i8_dot import quantize_blocks, quantized_blocks
from xinfer_cuda.kernels.plane_i8_gemv import PlaneI8GemvConfig, plane_i8_gemv, quantized_gemv

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def gemv_columns(fields: int) -> torch.Tensor:
    """The column of each byte of a tile's activations in the GEMV's order: per 16-byte load ``c`` of half ``h``
    of the codes (``load = 4 h + c``), nibbles (8 fields): 8 words ``(parity, j)`` of columns
    ``64 j + 32 h + 8 c + 2 i + parity``; bytes (4 fields): 4 words ``k`` of ``64 (k % 2) + 32 h + 8 c + 4 (k // 2) + i``."""
    load, word, i = torch.meshgrid(torch.arange(8), torch.arange(fields), torch.arange(4), indexing="ij")
    h, c = load // 4, load % 4
    if fields == 8:
        parity, j = word // 4, word % 4
        return (64 * j + 32 * h + 8 * c + 2 * i + parity).flatten()
    return (64 * (word % 2) + 32 * h + 8 * c + 4 * (word // 2) + i).flatten()


@pytest.mark.parametrize("fields", [4, 8])
def test_activations_are_stored_in_the_gemvs_order(fields):
    tiles = 5
    x = torch.randn(2, tiles * 32 * fields, device=DEVICE)
    q, d, s = quantize_blocks(x)
    q_gemv, d_gemv, s_gemv = quantize_blocks(x, order=fields)
    columns = torch.cat([t * 32 * fields + gemv_columns(fields) for t in range(tiles)])
    assert sorted(gemv_columns(fields).tolist()) == list(range(32 * fields))  # a permutation of the tile
    assert torch.equal(q_gemv.cpu(), q.cpu()[:, columns])
    assert torch.equal(d_gemv, d) and torch.equal(s_gemv, s)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_int8_gemv_is_the_weight_times_the_quantized_activations(name):
    """21 rows of the weight (tiles of 2, 4 and 8 rows: the last cut), 3 tiles a row (a loop step of 16 cut), with
    a bias, 1 to 4 warps, a row or two a thread; then split along K (2 programs, their partial sums and the bias
    added by a second kernel); then 8 rows of 16 tiles, no step cut."""
    n, k = 21, 3 * LAYOUTS[name].tile
    packed = random_packed(n, k, FORMATS[name], device=DEVICE)
    planes = to_planes(packed, LAYOUTS[name])
    x, bias = torch.randn(1, k, device=DEVICE).to(DTYPE), torch.randn(n, device=DEVICE).to(DTYPE)
    want, plain = (product + bias.cpu().double() for product in int8_products(x, packed, planes, name))
    configs = (
        PlaneI8GemvConfig(2, 1),
        PlaneI8GemvConfig(4, 2),
        PlaneI8GemvConfig(4, 4),
        PlaneI8GemvConfig(8, 4, split=2),
    )
    for config in configs:
        check_int8(plane_i8_gemv(x, planes, name, n, bias, config), want, plain)
    n, k = 8, 16 * LAYOUTS[name].tile
    packed = random_packed(n, k, FORMATS[name], device=DEVICE)
    planes = to_planes(packed, LAYOUTS[name])
    x = torch.randn(1, k, device=DEVICE).to(DTYPE)
    check_int8(
        plane_i8_gemv(x, planes, name, n, None, PlaneI8GemvConfig(8, 4)), *int8_products(x, packed, planes, name)
    )


@pytest.mark.parametrize("name", ["Q8_0", "Q4_K"])  # 4 fields a word, 8
@pytest.mark.parametrize("with_residual", [False, True], ids=["alone", "residual"])
def test_the_norms_kernel_quantizes_its_output_for_the_int8_gemv(name, with_residual):
    """The RMSNorm kernel with ``quantized``: its output and new residual as without, the output's codes, scales and
    sums those of quantize_blocks of that output (rounded to its dtype) in the GEMV's order, bit for bit, and the
    int8 GEMV of them that of the output."""
    fields, k = LAYOUTS[name].fields, 2 * LAYOUTS[name].tile
    x, weight = torch.randn(1, k, device=DEVICE).to(DTYPE), (torch.rand(k, device=DEVICE) + 0.5).to(DTYPE)
    residual = torch.randn(1, k, device=DEVICE).to(DTYPE) if with_residual else None
    quantized = quantized_blocks(1, k, DEVICE)
    done = rms_norm(x, weight, 1e-6, residual, quantized=quantized, order=fields)
    plain = rms_norm(x, weight, 1e-6, residual)
    if residual is not None:
        (out, h), (plain, plain_h) = done, plain
        assert torch.equal(h, plain_h)
    else:
        out = done
    assert torch.equal(out, plain)
    for got, want in zip(quantized, quantize_blocks(out, order=fields), strict=True):
        assert torch.equal(got, want)
    planes = to_planes(random_packed(8, k, FORMATS[name], device=DEVICE), LAYOUTS[name])
    assert torch.equal(quantized_gemv(quantized, planes, name, 8, out.dtype), plane_i8_gemv(out, planes, name, 8))
