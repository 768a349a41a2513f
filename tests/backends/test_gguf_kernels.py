"""The GGUF packed-weight kernels (:mod:`xinfer_cuda.kernels.quant_linear`) against
``gguf.quants.dequantize`` (the gguf package's numpy decoding of llama.cpp's blocks)
followed by an fp32 matmul on the CPU, on the device ``XINFER_KERNEL_DEVICE`` picks (on
"cpu" under the Triton interpreter; see tests/conftest.py).

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

from xinfer import ops
from xinfer.quant import get_weight_format, quantized
from xinfer.quant.gguf_formats import GGUF_FORMATS
from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import quant_linear as quant_linear_module
from xinfer_cuda.kernels import quant_moe
from xinfer_cuda.kernels.gguf_blocks import FORMATS, BlockFormat, random_packed
from xinfer_cuda.kernels.quant_linear import QDotConfig, QGemvConfig, dequantize, linear_rows, quant_linear
from xinfer_cuda.ops import CudaOps
from xinfer_cuda.quant_weights import MeasuredTiles, candidates

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAMES = [f.name.upper() for f in GGUF_FORMATS]  # FP8: test_fp8_kernels.py


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
    """The dot kernel: 3 rows in a 16-row tile, 19 rows over two tiles of a wider step; and split
    along K in 2 programs a tile (the second with the row's last loop step), their partial sums and
    the bias added by the second kernel."""
    fmt = FORMATS[name]
    run_case(name, 3, 37, odd_k(fmt), dtype, with_bias=True)
    run_case(name, 19, 20, odd_k(fmt), dtype, QDotConfig(16, 16, 512 // fmt.qk, 4, 2))
    run_case(name, 5, 20, odd_k(fmt), dtype, QDotConfig(16, 16, max(1, 64 // fmt.qk), 4, 2, split=2), with_bias=True)


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


# --- fused MoE over packed expert stacks -----------------------------------------------------------


def packed_experts(name: str, experts: int, hidden: int, inter: int) -> tuple[Tensor, Tensor]:
    fmt = FORMATS[name]
    w13 = random_packed(experts * 2 * inter, hidden, fmt, device=DEVICE).view(experts, 2 * inter, -1)
    w2 = random_packed(experts * hidden, inter, fmt, device=DEVICE).view(experts, hidden, -1)
    return w13, w2


def reference_moe(x, w13, w2, name, weights, ids, activation) -> Tensor:
    dense13 = reference_weight(w13.reshape(-1, w13.shape[-1]), name).view(w13.shape[0], w13.shape[1], -1)
    dense2 = reference_weight(w2.reshape(-1, w2.shape[-1]), name).view(w2.shape[0], w2.shape[1], -1)
    return TorchOps().fused_moe(x.cpu().float(), dense13, dense2, weights.cpu(), ids.cpu(), activation)


def routing(tokens: int, experts: int, top_k: int) -> tuple[Tensor, Tensor]:
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k)
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


# the MoE kernels' own code is the same for every format (the decoding is tested above)
MOE_NAMES = NAMES if ON_GPU else ["Q8_0", "Q4_0", "Q4_K", "Q6_K"]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid's inf is right
@pytest.mark.parametrize("name", MOE_NAMES)
def test_fused_moe_per_slot(name):
    """2 tokens, 2 of 4 experts each, in tiles of 64 rows (on the CPU: the interpreter's time
    goes by programs); a 32-value format's 96 gate/up rows end in a part tile."""
    fmt = FORMATS[name]
    hidden, inter = (256, 256) if fmt.qk == 256 else (64, 96)
    w13, w2 = packed_experts(name, 4, hidden, inter)
    weights, ids = routing(2, 4, 2)
    cases = [(torch.float32, "silu")] + ([(torch.float16, "gelu_pytorch_tanh")] if name == "Q4_K" else [])
    for dtype, activation in cases:
        x = torch.randn(2, hidden, device=DEVICE).to(dtype)
        out = quant_moe.fused_moe(x, w13, w2, name, weights, ids, activation, block_n=64)
        check(out, reference_moe(x, w13, w2, name, weights, ids, activation), dtype)


# --- the backend's declaration through the quantized-weight seam -------------------------------------


def test_cuda_ops_declare_every_gguf_block_format_fp8_and_fp4():
    assert set(CudaOps.weight_kernels) == {f.name for f in GGUF_FORMATS} | {"fp8", "mxfp4", "nvfp4"}


def test_linear_and_moe_dispatch_to_the_kernels():
    """ops.linear and ops.fused_moe on quantized weights reach these kernels under CudaOps
    (a leading batch dimension kept; past MAX_SLOTS slots the experts one by one)."""
    backend = CudaOps()
    fmt = get_weight_format("q4_0")
    packed = random_packed(5, 64, FORMATS["Q4_0"], device=DEVICE)
    weight, bias = quantized(packed, fmt, (5, 64)), torch.randn(5, device=DEVICE)
    x = torch.randn(2, 3, 64, device=DEVICE)
    with ops.use(backend):
        out = ops.linear(x, weight, bias)
    check(out, x.cpu() @ reference_weight(packed, "Q4_0").T + bias.cpu(), torch.float32)

    w13, w2 = packed_experts("Q4_0", 4, 64, 32)
    q13, q2 = quantized(w13, fmt, (4, 64, 64)), quantized(w2, fmt, (4, 64, 32))
    for tokens in (1, quant_moe.MAX_SLOTS // 2 + 1):
        x = torch.randn(tokens, 64, device=DEVICE)
        weights, ids = routing(tokens, 4, 2)
        with ops.use(backend):
            out = ops.fused_moe(x, q13, q2, weights, ids, "silu")
        check(out, reference_moe(x, w13, w2, "Q4_0", weights, ids, "silu"), torch.float32)


def test_many_rows_multiply_the_dequantized_weight(monkeypatch):
    """Past MAX_PACKED_ROWS rows (prefill) a linear, and an expert's slots, multiply the weight
    dequantized for the call: the packed dot kernel is not launched."""

    def no_dot_kernel(*args, **kwargs):
        raise AssertionError("the packed dot kernel ran for a prefill-sized product")

    monkeypatch.setattr(quant_linear_module, "quant_linear", no_dot_kernel)
    fmt = get_weight_format("q4_k")
    packed = random_packed(6, 256, FORMATS["Q4_K"], device=DEVICE)
    weight, bias = quantized(packed, fmt, (6, 256)), torch.randn(6, device=DEVICE)
    x = torch.randn(quant_linear_module.MAX_PACKED_ROWS + 3, 256, device=DEVICE)
    with ops.use(CudaOps()):
        out = ops.linear(x, weight, bias)
    check(out, x.cpu() @ reference_weight(packed, "Q4_K").T + bias.cpu(), torch.float32)

    w13, w2 = packed_experts("Q4_K", 2, 256, 256)
    tokens = quant_linear_module.MAX_PACKED_ROWS + 1  # both experts of every token: each gets them all
    weights, ids = torch.full((tokens, 2), 0.5, device=DEVICE), torch.tensor([[0, 1]] * tokens, device=DEVICE)
    x = torch.randn(tokens, 256, device=DEVICE)
    out = quant_moe.expert_by_expert(x, w13, w2, "Q4_K", weights, ids, CudaOps().silu_and_mul)
    check(out, reference_moe(x, w13, w2, "Q4_K", weights, ids, "silu"), torch.float32)


def test_measured_tiles_take_the_fastest_candidate_once_per_shape():
    """Each (format, shape, row count: 1, up to 16, then powers of two) is timed once over every candidate (the fake
    timer's order: the third is fastest for one row, the last, the dequantized weight, for 3, 4 and 9 rows, all of
    them 16-row tiles), and the chosen tile computes the product."""
    measured = []

    def timer(call, weights):
        y = call(weights[0])
        measured.append(y.shape[0])
        fastest = 2 if y.shape[0] == 1 else len(candidates(FORMATS["Q4_K"], 4)) - 1
        return 1.0 if measured.count(y.shape[0]) - 1 == fastest else 2.0

    tiles = MeasuredTiles(timer, copies=lambda w: [w])
    packed = random_packed(8, 256, FORMATS["Q4_K"], device=DEVICE)
    for rows in (1, 3, 4, 9, 1):
        x = torch.randn(rows, 256, device=DEVICE)
        tile = tiles(x, packed, "Q4_K", None)
        check(linear_rows(x, packed, "Q4_K", None, tile), x.cpu() @ reference_weight(packed, "Q4_K").T, torch.float32)
    one, few = candidates(FORMATS["Q4_K"], 1), candidates(FORMATS["Q4_K"], 4)
    assert measured == [1] * len(one) + [3] * len(few)
    assert list(tiles.choice.values()) == [one[2], few[-1]]
