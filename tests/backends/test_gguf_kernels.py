"""The GGUF packed-weight kernels (:mod:`xinfer_cuda.kernels.quant_linear`) against
``gguf.quants.dequantize`` (the gguf package's numpy decoding of llama.cpp's blocks)
followed by an fp32 matmul on the CPU, on the device ``XINFER_KERNEL_DEVICE`` picks (on
"cpu" under the Triton interpreter; see conftest.py).

Weights are random bytes with finite fp16 scales (:func:`random_packed`): every code,
sub-block scale and high bit takes random values. Shapes have a row count no tile
divides and a number of blocks no loop step divides (on "cpu" small ones, fp32 and
fp16; on a GPU also Llama-3.1-8B's projections in bf16). Tolerances are those of
test_cuda_kernels.py; the dequantize kernel must match bit for bit in fp32.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import Tensor

from xinfer_cuda.kernels.gguf_blocks import FORMATS, BlockFormat, random_packed
from xinfer_cuda.kernels.quant_linear import QDotConfig, QGemvConfig, dequantize, quant_linear

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAMES = list(FORMATS)


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def odd_k(fmt: BlockFormat) -> int:
    """A row of 3 blocks of a K-quant, 5 of a 32-value format: no loop step divides it."""
    return fmt.qk * (3 if fmt.qk == 256 else 5)


def reference_weight(packed: Tensor, name: str) -> Tensor:
    return torch.from_numpy(quants.dequantize(packed.cpu().numpy(), GGMLQuantizationType[name])).float()


def check(out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    out64, ref64 = out.detach().cpu().double(), ref.double()
    assert torch.isfinite(out64).all(), "non-finite output: unwritten elements or NaN"
    err = ((out64 - ref64).norm() / ref64.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e} over {TOL[dtype]:.0e} ({dtype})"


def run_case(name: str, m: int, n: int, k: int, dtype: torch.dtype, config=None, with_bias: bool = False) -> None:
    fmt = FORMATS[name]
    packed = random_packed(n, k, fmt, device=DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEVICE)
    quant_linear(x, packed, name, bias, config, out=out)
    ref = x.cpu().float() @ reference_weight(packed, name).T
    if bias is not None:
        ref += bias.cpu().float()
    check(out, ref, dtype)


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_matches_gguf_bit_for_bit(name):
    fmt = FORMATS[name]
    packed = random_packed(7, odd_k(fmt), fmt, device=DEVICE)
    out = dequantize(packed, name, odd_k(fmt), torch.float32)
    assert torch.equal(out.cpu(), reference_weight(packed, name))


SMALL_DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_one_row(name, dtype):
    """The GEMV, in the default tile (which then divides the rows and blocks, and then not)
    and in one of 2 rows whose loop step spans every block."""
    fmt = FORMATS[name]
    run_case(name, 1, 8, 512, dtype)
    run_case(name, 1, 7, odd_k(fmt), dtype, with_bias=True)
    run_case(name, 1, 6, odd_k(fmt), dtype, QGemvConfig(2, 256 // fmt.qk * 2, 2))


@pytest.mark.parametrize("dtype", SMALL_DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_several_rows(name, dtype):
    """The dot kernel: 3 rows in a 16-row tile, 19 rows over two tiles of a wider step."""
    fmt = FORMATS[name]
    run_case(name, 3, 37, odd_k(fmt), dtype, with_bias=True)
    run_case(name, 19, 20, odd_k(fmt), dtype, QDotConfig(16, 16, 512 // fmt.qk, 4, 2))


# Llama-3.1-8B's down projection at batch 1, qkv at 16 rows, o in a prefill of 300 tokens
LARGE = [(1, 4096, 14336), (16, 6144, 4096), (300, 4096, 4096)]


@pytest.mark.skipif(not ON_GPU, reason="real shapes take minutes under the interpreter; small ones run above")
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K"])
def test_real_shapes(name, shape):
    run_case(name, *shape, torch.bfloat16)


def test_unknown_format_and_ragged_rows_are_clear_errors():
    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="no kernel for GGUF type 'IQ2_XXS'"):
        quant_linear(x, torch.zeros(4, 64, dtype=torch.uint8, device=DEVICE), "IQ2_XXS")
    with pytest.raises(ValueError, match="Q4_K: a row of 64 values is not a whole number of 256-value blocks"):
        quant_linear(x, torch.zeros(4, 36, dtype=torch.uint8, device=DEVICE), "Q4_K")
