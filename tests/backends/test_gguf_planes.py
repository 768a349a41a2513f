"""GGUF weights in planes (:mod:`xinfer_cuda.kernels.gguf_planes`), the CUDA backend's load-time layout
of a linear's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K weight, and its kernels
(:mod:`xinfer_cuda.kernels.plane_linear`), against ``gguf.quants.dequantize`` of the file's bytes
followed by an fp32 matmul on the CPU (as test_gguf_kernels.py), on the device
``XINFER_KERNEL_DEVICE`` picks (under the Triton interpreter on "cpu").

Weights are random bytes with finite fp16 scales (:func:`random_packed`); rows of 3 tiles and 7
rows of the weight: no loop step and no row tile divides them.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from torch import Tensor

from tests.backends.test_gguf_kernels import check, reference_weight
from tests.backends.test_plane_i8_dot import check_int8, int8_products
from xinfer import ops
from xinfer.layers.embedding import VocabEmbedding
from xinfer.quant import QuantizedTensor, cat_rows, get_weight_format, quantized
from xinfer.quant.dispatch import prepare_weights
from xinfer_cuda.kernels import quant_linear as quant_linear_module
from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.kernels.gguf_planes import LAYOUTS, from_planes, to_planes
from xinfer_cuda.kernels.norm import rms_norm
from xinfer_cuda.kernels.plane_i8_dot import PlaneI8DotConfig
from xinfer_cuda.kernels.plane_i8_gemv import PlaneI8GemvConfig
from xinfer_cuda.kernels.plane_linear import (
    PlaneDotConfig,
    PlaneGemvConfig,
    plane_dequantize,
    plane_dot,
    plane_gemv,
    plane_rows,
)
from xinfer_cuda.kernels.quant_linear import DEQUANTIZED
from xinfer_cuda.ops import CudaOps
from xinfer_cuda.quant_weights import GGUF_KERNELS, GgufPlanes, MeasuredTiles, PlaneKernels, plane_candidates

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
NAMES = list(LAYOUTS)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def weight(name: str, n: int = 7, tiles: int = 3) -> tuple[Tensor, Tensor, int]:
    """A random weight [n, tiles * tile] in the file's bytes, those bytes in planes, and K."""
    k = LAYOUTS[name].tile * tiles
    packed = random_packed(n, k, FORMATS[name], device=DEVICE)
    return packed, to_planes(packed, LAYOUTS[name]), k


@pytest.mark.parametrize("name", NAMES)
def test_planes_keep_the_files_bytes_and_values(name):
    """The planes are as many bytes as the file's blocks and give them back exactly (also made a
    row at a time); the prepared weight dequantizes to the file's values."""
    packed, planes, k = weight(name, n=5)
    assert planes.numel() == packed.numel()
    assert torch.equal(to_planes(packed, LAYOUTS[name], chunk_bytes=1), planes)
    assert torch.equal(from_planes(planes, LAYOUTS[name], 5, k), packed)
    prepared = GGUF_KERNELS.prepare(quantized(packed, get_weight_format(name.lower()), (5, k)))
    assert isinstance(prepared.format, GgufPlanes) and prepared.nbytes == packed.numel()
    assert torch.equal(prepared.dequantize().cpu(), reference_weight(packed, name))


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_kernel_matches_gguf_bit_for_bit(name):
    packed, planes, k = weight(name)
    expected = reference_weight(packed, name)
    assert torch.equal(plane_dequantize(planes, name, 7, k, torch.float32).cpu(), expected)
    # a program's rows and tiles past the weight's (7 rows of 3 tiles), as other tiles of the kernel leave them
    assert torch.equal(plane_dequantize(planes, name, 7, k, torch.float32, block_n=4, tiles=2).cpu(), expected)


SMALL_DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32]


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_gemv(name, dtype):
    """One row: with a bias in a tile that divides nothing, and (the same code for every type) split
    over K in 3 programs a row tile, their partial sums added by the second kernel."""
    packed, planes, k = weight(name)
    ref = reference_weight(packed, name)
    x, bias = torch.randn(1, k, device=DEVICE).to(dtype), torch.randn(7, device=DEVICE).to(dtype)
    out = plane_gemv(x, planes, name, 7, bias, PlaneGemvConfig(4, 2, 4))
    check(out, x.cpu().float() @ ref.T + bias.cpu().float(), dtype)
    if name == "Q4_K":
        check(plane_gemv(x, planes, name, 7, None, PlaneGemvConfig(2, 1, 2, split=3)), x.cpu().float() @ ref.T, dtype)


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_dot(name, dtype):
    """A few rows: 5 in a 16-row tile with a bias, the weight's rows over two 16-row tiles and its tiles
    two a loop step (the last step half past the row); and split along K in 3 programs a tile, a tile of
    the row each, their partial sums and the bias added by the second kernel."""
    packed, planes, k = weight(name, n=20)
    ref = reference_weight(packed, name)
    x, bias = torch.randn(5, k, device=DEVICE).to(dtype), torch.randn(20, device=DEVICE).to(dtype)
    want = x.cpu().float() @ ref.T + bias.cpu().float()
    check(plane_dot(x, planes, name, 20, bias, PlaneDotConfig(16, 16, 2, 4, 2)), want, dtype)
    if name in ("Q8_0", "Q4_K", "Q6_K"):  # a type of each decode: the split is the same code for every type
        check(plane_dot(x, planes, name, 20, bias, PlaneDotConfig(16, 16, 1, 4, 2, split=3)), want, dtype)


# a type of each decode (bytes, nibbles, nibbles and high bits), one with fp16 activations
IN_FLIGHT_CASES = [("Q8_0", SMALL_DTYPES[0]), ("Q4_K", torch.float16), ("Q6_K", SMALL_DTYPES[0])]


@pytest.mark.parametrize(("name", "dtype"), IN_FLIGHT_CASES, ids=str)
def test_gemv_tiles_in_flight(name, dtype):
    """The one-row tiles that load the first step before the chain's wait (and unroll the loop), that give
    a thread a group's loads: over 5 tiles of a row (no step divides them), and split in 3 programs over K."""
    packed, planes, k = weight(name, n=9, tiles=5)
    ref = reference_weight(packed, name)
    x, bias = torch.randn(1, k, device=DEVICE).to(dtype), torch.randn(9, device=DEVICE).to(dtype)
    want = x.cpu().float() @ ref.T + bias.cpu().float()
    for tile in (
        PlaneGemvConfig(4, 2, 2, early=True, unroll=2, groups=True),
        PlaneGemvConfig(8, 1, 2, split=3, early=True),
    ):
        check(plane_gemv(x, planes, name, 9, bias, tile), want, dtype)


def test_fp16_activations():
    """Activations in half precision (the interpreter's fp32 cases above; bf16 on a GPU)."""
    packed, planes, k = weight("Q4_K")
    x = torch.randn(3, k, device=DEVICE).half()
    ref = x.cpu().float() @ reference_weight(packed, "Q4_K").T
    check(plane_gemv(x[:1], planes, "Q4_K", 7), ref[:1], torch.float16)
    check(plane_dot(x, planes, "Q4_K", 7), ref, torch.float16)


# Llama-3.1-8B's down projection and LM head at batch 1, qkv at 16 rows, gate/up at 64
LARGE = [(1, 4096, 14336), (1, 128256, 4096), (16, 6144, 4096), (64, 28672, 4096)]


@pytest.mark.skipif(not ON_GPU, reason="real shapes take minutes under the interpreter; small ones run above")
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q4_0"])
def test_real_shapes_in_every_candidate_tile(name, shape):
    m, n, k = shape
    packed = random_packed(n, k, FORMATS[name], device=DEVICE)
    planes = to_planes(packed, LAYOUTS[name])
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    ref = x.cpu().float() @ reference_weight(packed, name).T
    int8 = None
    for tile in plane_candidates(LAYOUTS[name], m):
        out = plane_rows(x, planes, name, None, tile)
        if isinstance(tile, (PlaneI8DotConfig, PlaneI8GemvConfig)):  # the quantized activations' error: as theirs
            int8 = int8 or int8_products(x, packed, planes, name)
            check_int8(out, *int8)
        else:
            check(out, ref, torch.bfloat16)


def test_linears_are_prepared_into_planes_and_dispatched(monkeypatch):
    """Under CudaOps a linear's Q4_K weight is re-laid at load and ops.linear runs the plane kernels
    for one row, a few, and past MAX_PACKED_ROWS (the weight dequantized for the call); a looked-up
    table and stacked experts keep the file's blocks, as a type without planes (Q2_K) does."""
    packed, _, k = weight("Q4_K", n=6, tiles=1)
    model = torch.nn.Module()
    model.proj = torch.nn.Linear(k, 6)
    model.proj.weight = torch.nn.Parameter(quantized(packed, get_weight_format("q4_k"), (6, k)), requires_grad=False)
    model.table = VocabEmbedding(6, k)
    model.table.weight = torch.nn.Parameter(quantized(packed.clone(), get_weight_format("q4_k"), (6, k)),
                                            requires_grad=False)  # fmt: skip
    experts = random_packed(12, k, FORMATS["Q4_K"], device=DEVICE).view(2, 6, -1)
    model.experts = torch.nn.Parameter(quantized(experts, get_weight_format("q4_k"), (2, 6, k)), requires_grad=False)
    q2 = random_packed(6, k, FORMATS["Q2_K"], device=DEVICE)
    model.q2 = torch.nn.Parameter(quantized(q2, get_weight_format("q2_k"), (6, k)), requires_grad=False)
    backend = CudaOps()
    prepare_weights(model, backend)
    assert model.proj.weight.format.name == "q4_k:cuda-planes" and model.proj.weight.nbytes == packed.numel()
    assert [model.table.weight.format.name, model.experts.format.name, model.q2.format.name] == ["q4_k"] * 2 + ["q2_k"]

    def no_file_kernel(*args, **kwargs):
        raise AssertionError("the kernel of the file's blocks ran for a weight in planes")

    monkeypatch.setattr(quant_linear_module, "quant_linear", no_file_kernel)
    ref, bias = reference_weight(packed, "Q4_K"), torch.randn(6, device=DEVICE)
    for rows in (1, 3, quant_linear_module.MAX_PACKED_ROWS + 1):
        x = torch.randn(rows, k, device=DEVICE)
        with ops.use(backend):
            out = ops.linear(x, model.proj.weight, bias)
        check(out, x.cpu() @ ref.T + bias.cpu(), torch.float32)


def test_measured_tiles_time_the_plane_candidates():
    """With ``planes`` the measured tiles are the planes' candidates, run by plane_rows (the fake
    timer's fastest: the second for one row, the dequantized weight for 3 rows)."""
    measured = []

    def timer(call, weights):
        y = call(weights[0])
        measured.append(y.shape[0])
        fastest = 1 if y.shape[0] == 1 else len(plane_candidates(LAYOUTS["Q8_0"], 4, int8_activations=False)) - 1
        return 1.0 if measured.count(y.shape[0]) - 1 == fastest else 2.0

    tiles = MeasuredTiles(timer, copies=lambda w: [w], planes=True)
    packed, planes, k = weight("Q8_0", n=4, tiles=1)
    for rows in (1, 3, 1):
        x = torch.randn(rows, k, device=DEVICE)
        tile = tiles(x, planes, "Q8_0", None)
        check(plane_rows(x, planes, "Q8_0", None, tile), x.cpu() @ reference_weight(packed, "Q8_0").T, torch.float32)
    # fp32 activations: no int8 kernel among them
    one, few = (plane_candidates(LAYOUTS["Q8_0"], rows, int8_activations=False) for rows in (1, 4))
    assert not any(isinstance(tile, (PlaneI8DotConfig, PlaneI8GemvConfig)) for tile in one + few)
    assert any(isinstance(tile, PlaneI8DotConfig) for tile in plane_candidates(LAYOUTS["Q8_0"], 4))  # 16-bit ones
    assert any(isinstance(tile, PlaneI8GemvConfig) for tile in plane_candidates(LAYOUTS["Q8_0"], 1))
    # from 64 rows 16-bit activations take the int8 dots or the dequantized weight; fp32 ones keep the bf16 dots
    many, many_fp32 = plane_candidates(LAYOUTS["Q8_0"], 64), plane_candidates(LAYOUTS["Q8_0"], 64, False)
    assert not any(isinstance(tile, PlaneDotConfig) for tile in many) and DEQUANTIZED in many
    assert any(isinstance(tile, PlaneDotConfig) for tile in many_fp32)
    # before SM80 (no integer dot compiles there) no int8 dot, the bf16 dots at every row count; the one-row int8
    # GEMV (dp4a) stays
    few_sm75, many_sm75 = (plane_candidates(LAYOUTS["Q8_0"], rows, int8_tensor_cores=False) for rows in (4, 64))
    assert not any(isinstance(tile, PlaneI8DotConfig) for tile in few_sm75 + many_sm75)
    assert any(isinstance(tile, PlaneDotConfig) for tile in many_sm75)
    one_sm75 = plane_candidates(LAYOUTS["Q8_0"], 1, int8_tensor_cores=False)
    assert any(isinstance(tile, PlaneI8GemvConfig) for tile in one_sm75)
    assert measured == [1] * len(one) + [3] * len(few)
    assert list(tiles.choice.values()) == [one[1], few[-1]]


@pytest.mark.parametrize("int8", [False, True], ids=["float-gemv", "int8-gemv"])
def test_norm_linear_quantizes_in_the_norms_kernel_where_the_int8_gemv_is_measured_fastest(int8):
    """PlaneKernels.norm_linear of one row: where the measurement (a fake timer here) picks the int8 GEMV, the norm's
    kernel quantizes its output and the GEMV reads that: the result is the int8 GEMV of the normed row; else the
    norm, then the measured linear. On the CPU (interpreter) no tile is measured: the norm, then the linear."""
    _, planes, k = weight("Q4_K", n=8, tiles=2)
    kernels = PlaneKernels()

    def timer(call, weights):  # (MeasuredTiles' calls take their tile as a default argument)
        return 1.0 if isinstance(call.__defaults__[0], PlaneI8GemvConfig) == int8 else 2.0

    kernels.tiles = MeasuredTiles(timer, copies=lambda w: [w], planes=True)
    w = QuantizedTensor(planes, GgufPlanes(get_weight_format("q4_k"), 8, k), (8, k))
    x, residual = (torch.randn(1, k, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    norm_weight, bias = torch.rand(k, device=DEVICE).to(torch.bfloat16) + 0.5, torch.randn(8, device=DEVICE)
    y, normed, h = kernels.norm_linear(x, residual, norm_weight, 1e-6, w, bias.to(torch.bfloat16))
    want_normed, want_h = rms_norm(x, norm_weight, 1e-6, residual)
    assert torch.equal(normed, want_normed) and torch.equal(h, want_h)
    tile = next(iter(kernels.tiles.choice.values()), None)  # the one measured (none on the CPU)
    assert isinstance(tile, PlaneI8GemvConfig) == (int8 and ON_GPU)
    assert torch.equal(y, plane_rows(normed, planes, "Q4_K", bias.to(torch.bfloat16), tile))


def test_a_merged_weight_in_parts_of_several_formats_runs_each_part_in_its_planes():
    """A merged q/k/v whose rows the file stores in Q4_K, Q6_K and Q4_0 (test_gguf_packed's mix):
    each part is re-laid into its own planes at load and ops.linear gives the parts' values' product
    for one row, a few and past MAX_PACKED_ROWS. 5 Q6_K rows are 1050 bytes: the Q4_0 part after
    them starts where its int32 words are read only because parts start aligned."""
    names, rows, k = ["Q4_K", "Q6_K", "Q4_0"], [4, 5, 3], 256
    files = [random_packed(n, k, FORMATS[name], device=DEVICE) for name, n in zip(names, rows)]
    merged = cat_rows([quantized(raw, get_weight_format(name.lower()), (n, k))
                       for raw, name, n in zip(files, names, rows)])  # fmt: skip
    model = torch.nn.Module()
    model.qkv = torch.nn.Linear(k, sum(rows))
    model.qkv.weight = torch.nn.Parameter(merged, requires_grad=False)
    backend = CudaOps()
    prepare_weights(model, backend)
    parts = model.qkv.weight.parts or ()
    assert [p.format.name for p in parts] == [f"{name.lower()}:cuda-planes" for name in names]
    ref = torch.cat([reference_weight(raw, name) for raw, name in zip(files, names)])
    for m in (1, 5, quant_linear_module.MAX_PACKED_ROWS + 1):
        x = torch.randn(m, k, device=DEVICE)
        with ops.use(backend):
            check(ops.linear(x, model.qkv.weight), x.cpu() @ ref.T, torch.float32)
