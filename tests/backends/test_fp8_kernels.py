"""The packed-weight kernels (:mod:`xinfer_cuda.kernels.quant_linear`, ``quant_moe``) on FP8 blocks
(:mod:`xinfer.quant.fp8_format`: a float32 scale and 128 e4m3 codes) against the core format's
``dequantize`` (itself checked against torch's e4m3 in tests/quant/test_fp8_format.py) then an fp32
matmul on the CPU; on "cpu" under the Triton interpreter (see tests/conftest.py). Every e4m3 code but NaN
comes up in the random bytes, subnormals and negative zero included; rows no tile divides."""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor

from tests.backends.test_gguf_kernels import _seed, check  # noqa: F401 (the same kernels, bounds and seeds)
from xinfer import ops
from xinfer.quant import get_weight_format, quantized
from xinfer_cuda.fp8_tensor_cores import (
    FP8_KERNELS,
    GEMV_WARPS,
    TENSOR_CORE_KERNELS,
    quantize_activations,
    split,
    to_tensor_core_layout,
)
from xinfer_cuda.kernels import quant_linear as quant_linear_module
from xinfer_cuda.kernels.fp8_gemv import fp8_gemv
from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.kernels.quant_linear import QDotConfig, QGemvConfig, dequantize, quant_linear
from xinfer_cuda.ops import CudaOps

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
FP8 = FORMATS["FP8"]
CORE = get_weight_format("fp8")


def reference(packed: Tensor) -> Tensor:
    return CORE.dequantize(packed.cpu())


def run_case(m: int, n: int, k: int, dtype: torch.dtype, config=None, with_bias: bool = False) -> None:
    packed = random_packed(n, k, FP8, device=DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    quant_linear(x, packed, "FP8", bias, config, out=out)
    ref = x.cpu().float() @ reference(packed).T
    check(out, ref + bias.cpu().float() if bias is not None else ref, dtype)


@pytest.fixture(params=["integer", "conversion"])
def decoding(request, monkeypatch):
    """Each e4m3 decoding of the kernels: integer operations (SM70+), the hardware's conversion
    (SM89+; under the interpreter, its emulation)."""
    if request.param == "integer":
        monkeypatch.setattr(quant_linear_module, "converts_e4m3", lambda device: False)
    elif not ON_GPU or quant_linear_module.converts_e4m3(DEVICE):
        monkeypatch.setattr(quant_linear_module, "converts_e4m3", lambda device: True)
    else:
        pytest.skip("this GPU has no e4m3 conversion (SM89 and up)")
    return request.param


def test_dequantize_kernel_decodes_every_code_bit_for_bit(decoding):
    packed = random_packed(7, 3 * 128, FP8, device=DEVICE)
    packed[0, 4:132] = torch.arange(128, dtype=torch.uint8)  # every positive code but NaN (and 127: NaN)
    packed[0, 4 + 127] = 0x80  # negative zero
    packed[1, 4:132] = torch.arange(128, 256, dtype=torch.uint8)
    packed[1, 4 + 127] = 0x01
    assert torch.equal(dequantize(packed, "FP8", 3 * 128, torch.float32).cpu(), reference(packed))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_row(dtype, decoding):
    run_case(1, 8, 512, dtype)
    run_case(1, 7, 3 * 128, dtype, with_bias=True)
    run_case(1, 6, 3 * 128, dtype, QGemvConfig(2, 4, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_several_rows(dtype):
    run_case(3, 37, 3 * 128, dtype, with_bias=True)
    run_case(19, 20, 3 * 128, dtype, QDotConfig(16, 16, 2, 4, 2))


@pytest.mark.skipif(not ON_GPU, reason="real shapes take minutes under the interpreter; small ones run above")
@pytest.mark.parametrize("shape", [(1, 4096, 14336), (16, 6144, 4096), (300, 4096, 4096)], ids=str)
def test_real_shapes(shape):
    run_case(*shape, torch.bfloat16)


# --- the tensor-core path (SM90's default, XINFER_FP8_MATMUL to override) ------------------------------------


def test_tensor_core_layout_holds_the_same_values_in_the_same_bytes():
    packed = random_packed(6, 3 * 128, FP8)
    weight = quantized(packed, CORE, (6, 3 * 128))
    moved = to_tensor_core_layout(weight)
    assert moved.nbytes == weight.nbytes and moved.shape == weight.shape
    assert torch.equal(moved.dequantize(), weight.dequantize())


def test_activations_quantize_per_token_and_128_columns():
    x = torch.randn(3, 256) * torch.tensor([1e-2, 1.0, 30.0])[:, None]
    codes, scales = quantize_activations(x)
    assert scales.shape == (3, 2) and scales.stride() == (1, 3)  # column-major, as scaled_mm reads them
    assert quantize_activations(x[:1])[1].stride() == (1, 1)  # one row too (scaled_mm refuses (2, 1))
    back = codes.float() * scales.repeat_interleave(128, dim=1)
    assert torch.all((back - x).abs() <= x.abs() * 2**-4 + 1e-30)
    assert torch.allclose(back.unflatten(1, (2, 128)).abs().amax(-1), x.unflatten(1, (2, 128)).abs().amax(-1))


@pytest.mark.skipif(ON_GPU and torch.cuda.get_device_capability() < (8, 9), reason="e4m3 conversion: SM89 and up")
@pytest.mark.parametrize("n, k", [(13, 384), (8, 4096), (5, 4224)])  # rows no warp count divides, steps cut short
@pytest.mark.parametrize("dtype", DTYPES)
def test_one_row_gemv_reads_the_tensor_cores_layout(n, k, dtype):
    weight = quantized(random_packed(n, k, FP8, device=DEVICE), CORE, (n, k))
    codes, scales = split(to_tensor_core_layout(weight).raw)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    ref = x.cpu().float() @ reference(weight.raw).T
    for warps in GEMV_WARPS:
        check(fp8_gemv(x, codes, scales, None, warps), ref, dtype)
        check(fp8_gemv(x, codes, scales, bias, warps), ref + bias.cpu().float(), dtype)


SM90 = ON_GPU and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("selected", [None, "auto", "weight-only", "tensor-cores", "fastest"])
def test_the_tensor_cores_are_the_default_on_sm90_only(selected, monkeypatch):
    if selected is None:
        monkeypatch.delenv("XINFER_FP8_MATMUL", raising=False)
    else:
        monkeypatch.setenv("XINFER_FP8_MATMUL", selected)
    weight = quantized(random_packed(8, 256, FP8, device=DEVICE), CORE, (8, 256))
    if selected == "fastest" or (selected == "tensor-cores" and not SM90):
        with pytest.raises(ValueError, match="XINFER_FP8_MATMUL"):
            FP8_KERNELS.prepare(weight)
        return
    tensor_cores = SM90 and selected != "weight-only"
    expected = "fp8_tensor_cores" if tensor_cores else weight.format.name
    assert FP8_KERNELS.prepare(weight).format.name == expected


@pytest.mark.skipif(not SM90, reason="FP8 tensor cores with 1x128 block scales: SM90 (Hopper) only")
@pytest.mark.parametrize("rows", [1, 16, 17, 37, 300])  # cuBLAS takes multiples of 4 only: the others padded
def test_tensor_cores_match_the_weight_times_quantized_activations(rows, monkeypatch):
    monkeypatch.setenv("XINFER_FP8_MATMUL", "tensor-cores")
    backend = CudaOps()
    n, k = 4096, 2048
    weight = quantized(random_packed(n, k, FP8, scale=1e-2, device=DEVICE), CORE, (n, k))
    prepared = FP8_KERNELS.prepare(weight)
    assert prepared.format.name == "fp8_tensor_cores"
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    with ops.use(backend):
        out = ops.linear(x, prepared, None)
    codes, scales = quantize_activations(x)
    meant = codes.float() * scales.repeat_interleave(128, dim=1)
    if rows == 1 and TENSOR_CORE_KERNELS.one_row_warps(x, prepared.raw, None):  # the GEMV measured faster
        meant = x.float()
    check(out, meant.cpu() @ reference(weight.raw).T, torch.bfloat16)
