"""The packed-weight kernels (:mod:`xinfer_cuda.kernels.quant_linear`, ``quant_moe``) on MXFP4 and NVFP4
blocks (:mod:`xinfer.quant.fp4_formats`) against the core format's ``dequantize`` (itself checked against
a quantizer written from the spec in tests/quant/test_fp4_formats.py) then an fp32 matmul on the CPU; on
"cpu" under the Triton interpreter (see tests/conftest.py). Every e2m1 code comes up in the random bytes, every
e4m3 scale but NaN; rows no tile divides and rows of a number of blocks no loop step divides."""

from __future__ import annotations

import os

import pytest
import torch

from tests.backends.test_gguf_kernels import check  # the same packed kernels, the same bounds
from xinfer import ops
from xinfer.quant import get_weight_format, quantized
from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import quant_moe
from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.kernels.quant_linear import QDotConfig, QGemvConfig, dequantize, quant_linear
from xinfer_cuda.ops import CudaOps

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
NAMES = ["MXFP4", "NVFP4"]


def run_case(name: str, m: int, n: int, k: int, dtype: torch.dtype, config=None, with_bias: bool = False) -> None:
    packed = random_packed(n, k, FORMATS[name], device=DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    quant_linear(x, packed, name, bias, config, out=out)
    ref = x.cpu().float() @ get_weight_format(name.lower()).dequantize(packed.cpu()).T
    check(out, ref + bias.cpu().float() if bias is not None else ref, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_kernel_decodes_bit_for_bit(name):
    fmt = FORMATS[name]
    packed = random_packed(7, 3 * fmt.qk, fmt, device=DEVICE)
    core = get_weight_format(name.lower())
    assert torch.equal(dequantize(packed, name, 3 * fmt.qk, torch.float32).cpu(), core.dequantize(packed.cpu()))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_row(name, dtype):
    qk = FORMATS[name].qk
    run_case(name, 1, 8, 8 * qk, dtype)
    run_case(name, 1, 7, 3 * qk, dtype, with_bias=True)
    run_case(name, 1, 6, 5 * qk, dtype, QGemvConfig(2, 4, 2))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_several_rows(name, dtype):
    qk = FORMATS[name].qk
    run_case(name, 3, 37, 3 * qk, dtype, with_bias=True)
    run_case(name, 19, 20, 3 * qk, dtype, QDotConfig(16, 16, max(1, 64 // qk), 4, 2))


@pytest.mark.skipif(not ON_GPU, reason="real shapes take minutes under the interpreter; small ones run above")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1, 4096, 14336), (16, 6144, 4096), (300, 4096, 4096)], ids=str)
def test_real_shapes(name, shape):
    run_case(name, *shape, torch.bfloat16)


@pytest.mark.parametrize("name", ["FP8", *NAMES])
def test_linear_and_moe_dispatch_to_the_kernels(name):
    """ops.linear and ops.fused_moe on FP8 / MXFP4 / NVFP4 weights reach the kernels under CudaOps."""
    backend, fmt, core = CudaOps(), FORMATS[name], get_weight_format(name.lower())
    k = 2 * fmt.qk
    packed = random_packed(5, k, fmt, device=DEVICE)
    weight, bias = quantized(packed, core, (5, k)), torch.randn(5, device=DEVICE)
    x = torch.randn(2, 3, k, device=DEVICE)
    with ops.use(backend):
        out = ops.linear(x, weight, bias)
    check(out, x.cpu() @ core.dequantize(packed.cpu()).T + bias.cpu(), torch.float32)

    experts, hidden, inter = 4, fmt.qk, fmt.qk
    w13 = random_packed(experts * 2 * inter, hidden, fmt, device=DEVICE).view(experts, 2 * inter, -1)
    w2 = random_packed(experts * hidden, inter, fmt, device=DEVICE).view(experts, hidden, -1)
    q13, q2 = quantized(w13, core, (experts, 2 * inter, hidden)), quantized(w2, core, (experts, hidden, inter))
    x = torch.randn(2, hidden, device=DEVICE)
    ids = torch.tensor([[0, 3], [2, 3]], device=DEVICE)
    weights = torch.tensor([[0.7, 0.3], [0.4, 0.6]], device=DEVICE)
    with ops.use(backend):
        out = ops.fused_moe(x, q13, q2, weights, ids, "silu")
    dense13, dense2 = q13.dequantize().cpu(), q2.dequantize().cpu()  # (.cpu() of the subclass is its raw bytes)
    ref = TorchOps().fused_moe(x.cpu(), dense13, dense2, weights.cpu(), ids.cpu(), "silu")
    check(out, ref, torch.float32)
    assert quant_moe.MAX_SLOTS >= ids.numel()  # the fused kernel, not the expert-by-expert path
