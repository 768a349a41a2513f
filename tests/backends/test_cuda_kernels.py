"""The CUDA backend's Triton kernels against the plain-torch reference (``TorchOps``).

Each check draws fresh random inputs (never zeros), poisons the outputs with NaN before
the kernel runs (an unwritten element then fails the finiteness check), and compares
with ``TorchOps`` run on the CPU on the same inputs upcast to fp32, by the relative error
norm ||out - ref|| / ||ref|| computed in fp64. Tolerances (``TOL``):

- fp32: 2e-5. fp32 arithmetic (dots in "ieee" precision) lands near 1e-7.
- fp16: 2e-3. Output rounding (~3e-4); attention also rounds probabilities to fp16
  before P @ V, as flash attention does.
- bf16: 1e-2, GPU only (the Triton interpreter mishandles bf16). Same, at 8 bits.

The KV cache write is compared bit for bit.

The device comes from ``XINFER_KERNEL_DEVICE`` (set in tests/conftest.py). On "cpu" the
kernels run under ``TRITON_INTERPRET=1`` on small shapes in fp32 and fp16. On "cuda"
the small shapes run in bf16 and larger (Llama-3.1-8B-like) ones are added in every
dtype (attention: fp16 and bf16; its fp32 path is checked by the window, padding and
graph tests). Each distinct shape class and dtype is a Triton compile, so the GPU list
is kept to what adds coverage.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import threading
import zlib
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor
from triton.runtime.errors import OutOfResources

from xinfer.kv import LayerKVCache
from xinfer.ops import PRIMITIVES, AttentionMetadata, HeadNorms, Rotation
from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import activation, arrivals, attention, gemv, norm, norm_linear, rotary
from xinfer_cuda.linear import DOT_TILES, ONE_PASS_TILES, ONE_ROW_TILES, SmallBatchLinear, candidates, time_each
from xinfer_cuda.ops import CudaOps

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# The interpreter warns when exp overflows to inf in sigmoid; inf is the right value there.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

CPU = TorchOps()
CUDA = CudaOps()


@pytest.fixture(autouse=True)
def _seed(request):
    """A different, reproducible seed for every test case."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def matrix(small: list, large: list, large_dtypes: list[torch.dtype] = DTYPES) -> list:
    """(case, dtype) pairs: the small cases in every dtype on the CPU and in bf16 on a GPU,
    the large (GPU-only) cases in ``large_dtypes``."""
    if not ON_GPU:
        pairs = [(case, dtype) for case in small for dtype in DTYPES]
    else:
        pairs = [(case, torch.bfloat16) for case in small]
        pairs += [(case, dtype) for case in large for dtype in large_dtypes]
    return [pytest.param(case, dtype, id=f"{case}-{str(dtype)[6:]}") for case, dtype in pairs]


def rand(*shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def nan_like(x: Tensor) -> Tensor:
    return torch.full_like(x, float("nan"))


def ref32(x: Tensor) -> Tensor:
    """An input as the reference sees it: on the CPU, in fp32."""
    return x.detach().cpu().float()


def rel_err(out: Tensor, ref: Tensor) -> float:
    out, ref = out.detach().cpu().double(), ref.detach().cpu().double()
    assert torch.isfinite(out).all(), "non-finite output: unwritten elements or NaN"
    return ((out - ref).norm() / ref.norm()).item()


def check(out: Tensor, ref: Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype
    err = rel_err(out, ref)
    assert err < TOL[dtype], f"relative error {err:.2e} over {TOL[dtype]:.0e} ({dtype})"


def test_every_op_has_a_kernel():
    """No op of the interface falls through to the plain-torch reference on CUDA."""
    assert [name for name in PRIMITIVES if name not in vars(CudaOps)] == []


# --- Linear over a few rows --------------------------------------------------------

# (rows, N, K): sizes no tile divides mask the last rows and columns
# (on a GPU each case compiles every tile: the large ones in bf16, and fp32, which tiny
# test models run in)
GEMV_SHAPES = matrix(
    [(1, 37, 100), (1, 64, 1024), (1, 5, 1030), (3, 40, 96), (16, 64, 512)],
    [(1, 4096, 14336), (1, 32003, 4096), (5, 4096, 4096), (16, 28672, 4096)],
    large_dtypes=[torch.bfloat16, torch.float32],
)


@pytest.mark.parametrize("shape, dtype", GEMV_SHAPES)
def test_gemv(shape, dtype):
    """Every tile the measurement may pick for that many rows."""
    m, n, k = shape
    x, weight, bias = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, scale=k**-0.5), rand(n, dtype=dtype)
    for tile, b in itertools.product(candidates(m), (None, bias)):
        out = gemv.gemv(x, weight, b, tile, out=rand(m, n, dtype=dtype) * math.nan)
        check(out, CPU.linear(ref32(x), ref32(weight), None if b is None else ref32(b)), dtype)


def test_small_batch_linear_takes_a_kernel_only_where_measured_faster():
    """Each weight shape and power-of-two row count is measured once: cuBLAS first,
    then each candidate tile (the fake timer's order); a tile replaces cuBLAS only
    when clearly faster."""
    one, few = len(candidates(1)), len(candidates(4))
    times = {
        (1, (40, 64)): [10.0] + [9.9] * one,  # within the margin: cuBLAS stays
        (1, (24, 64)): [10.0] + [9.0] * 2 + [8.0] + [9.0] * (one - 3),
        (4, (24, 64)): [10.0] + [9.5] * (few - 1) + [7.0],
    }
    measured = []

    def timer(call, weights):
        rows = call(weights[0]).shape[0]
        key = (1 << (rows - 1).bit_length(), tuple(weights[0].shape))
        measured.append(key)
        return times[key][measured.count(key) - 1]

    linear = SmallBatchLinear(timer, copies=lambda w: [w])
    for rows, shape in ((1, (40, 64)), (1, (24, 64)), (3, (24, 64)), (4, (24, 64)), (1, (40, 64))):
        x, weight = rand(rows, shape[1]), rand(*shape)
        check(linear(x, weight), CPU.linear(ref32(x), ref32(weight)), torch.float32)
    assert measured == [(1, (40, 64))] * (1 + one) + [(1, (24, 64))] * (1 + one) + [(4, (24, 64))] * (1 + few)
    assert {key[:2]: tile for key, tile in linear.choice.items()} == {
        (1, (40, 64)): None,
        (1, (24, 64)): ONE_ROW_TILES[2],
        (4, (24, 64)): DOT_TILES[-1],
    }
    report = linear.report()
    assert "measured 3 (row count, weight shape) pairs" in report and "own kernels for 2, cuBLAS for 1" in report
    assert linear.report() is None  # nothing measured since


def test_small_batch_linear_skips_tiles_the_gpu_lacks_resources_for():
    calls = []

    def timer(call, weights):  # cuBLAS 10, then every tile out of shared memory but the last (5)
        calls.append(call)
        if len(calls) == 1 + len(candidates(4)):
            return 5.0
        if len(calls) > 1:
            raise OutOfResources(300_000, 232_448, "shared memory")
        return 10.0

    linear = SmallBatchLinear(timer, copies=lambda w: [w])
    x, weight = rand(4, 64), rand(24, 64)
    check(linear(x, weight), CPU.linear(ref32(x), ref32(weight)), torch.float32)
    assert list(linear.choice.values()) == [DOT_TILES[-1]]


def test_candidates_run_side_by_side_before_they_are_timed_on_a_gpu():
    """On a GPU every candidate runs once in worker threads (their kernels compile side by side), on
    the caller's stream, before each is timed in the caller's thread; one lacking the GPU's resources
    is left out, as when timed alone. On the CPU (the interpreter) they are only timed."""
    runs: list[tuple[str, bool, object]] = []  # candidate, in the caller's thread, stream

    def call_of(name: str):
        def call(w: Tensor) -> Tensor:
            runs.append((name, threading.current_thread() is threading.main_thread(),
                         torch.cuda.current_stream() if ON_GPU else None))  # fmt: skip
            if name == "too big":
                raise OutOfResources(300_000, 232_448, "shared memory")
            return w + 1

        return call

    def timer(call, inputs):
        call(inputs[0])
        return 1.0

    names = ["a", "b", "too big", "c"]
    side = torch.cuda.Stream() if ON_GPU else None
    with torch.cuda.stream(side) if ON_GPU else contextlib.nullcontext():
        times = time_each(timer, {name: call_of(name) for name in names}, [rand(4)], DEVICE)
    assert times == {"a": 1.0, "b": 1.0, "c": 1.0}
    timed = [(name, True, side) for name in names]
    if ON_GPU:
        assert sorted(runs[:4], key=lambda run: names.index(run[0])) == [(name, False, side) for name in names]
        assert runs[4:] == timed
    else:
        assert runs == timed


# --- RMSNorm fused into the linear after it -----------------------------------------

NORM_LINEAR_SHAPES = matrix(
    [(1, 37, 100), (1, 64, 256), (3, 40, 96), (16, 24, 130)],
    [(1, 4096, 2048), (1, 128, 2048), (4, 5120, 2048)],
    large_dtypes=[torch.bfloat16],
)


def norm_linear_reference(x, residual, norm_weight, eps, weight, bias):
    return CPU.norm_linear(*(None if t is None else ref32(t) for t in (x, residual, norm_weight)), eps,
                           ref32(weight), None if bias is None else ref32(bias))  # fmt: skip


@pytest.mark.parametrize("shape, dtype", NORM_LINEAR_SHAPES)
def test_norm_linear(shape, dtype):
    """Every tile the measurement may pick (one row: also in one pass), with and without a
    residual and a bias: the projection, the normalized rows and the new residual."""
    m, n, k = shape
    x, residual, norm_weight = rand(m, k, dtype=dtype), rand(m, k, dtype=dtype), rand(k, dtype=dtype)
    weight, bias = rand(n, k, dtype=dtype, scale=k**-0.5), rand(n, dtype=dtype)
    tiles = candidates(m) + (ONE_PASS_TILES[:: 1 if ON_GPU else 3] if m == 1 else ())
    for i, (tile, r, b) in enumerate(itertools.product(tiles, (None, residual), (None, bias))):
        if ON_GPU or i % 2 == 0 or tile == tiles[-1]:  # (the interpreter: bias on the last tile alone)
            y, normed, h = norm_linear.norm_linear(x, r, norm_weight, 1e-5, weight, b, tile)
            ref_y, ref_normed, ref_h = norm_linear_reference(x, r, norm_weight, 1e-5, weight, b)
            check(y, ref_y, dtype)
            check(normed, ref_normed, dtype)
            check(h, ref_h, dtype)
            if r is None:
                assert h is x


@pytest.mark.parametrize("rows", [1, 5])
def test_norm_linear_fp32_weight(rows):
    """A router kept in fp32 behind a norm in the model's dtype: the normalized rows are
    rounded to that dtype, then the product is fp32 (as ``linear(normed.float(), w)``)."""
    dtype = torch.bfloat16 if ON_GPU else torch.float16
    x, residual, norm_weight = rand(rows, 96, dtype=dtype), rand(rows, 96, dtype=dtype), rand(96, dtype=dtype)
    weight = rand(24, 96, scale=96**-0.5)
    for tile in candidates(rows)[:: 1 if ON_GPU else 3]:
        y, normed, _ = norm_linear.norm_linear(x, residual, norm_weight, 1e-6, weight, None, tile)
        _, ref_normed, _ = norm_linear_reference(x, residual, norm_weight, 1e-6, weight, None)
        check(normed, ref_normed, dtype)
        exact = ref32(normed) @ ref32(weight).T  # the product of the kernel's own rounded rows
        check(y, exact, torch.float32)


def test_small_batch_norm_linear_fuses_only_where_measured_faster():
    """The fused kernel replaces the norm-then-linear baseline only when clearly faster,
    measured once per (rows, weight shape, residual) and reported apart from the linears."""
    x, residual, norm_weight, weight = rand(1, 64), rand(1, 64), rand(64), rand(40, 64)
    unfused_calls = []

    def unfused(w):
        unfused_calls.append(w)
        return CPU.norm_linear(x, residual, norm_weight, 1e-6, w)

    for fused_time, expect_fused in ((9.9, False), (8.0, True)):
        times = iter([10.0] + [fused_time] * len(candidates(1) + ONE_PASS_TILES))

        def timer(call, weights, times=times):
            call(weights[0])
            return next(times)

        linear = SmallBatchLinear(timer, copies=lambda w: [w])
        for measuring in (True, False):
            unfused_calls.clear()
            y, normed, h = linear.norm_linear(x, residual, norm_weight, 1e-6, weight, None, unfused)
            ref_y, ref_normed, ref_h = CPU.norm_linear(x, residual, norm_weight, 1e-6, weight)
            check(y, ref_y, torch.float32)
            check(normed, ref_normed, torch.float32)
            check(h, ref_h, torch.float32)
            if not measuring:  # (the measurement times the baseline)
                assert (unfused_calls == []) == expect_fused
        assert len(linear.choice) == 1
        report = linear.report()
        assert f"the norm fused into the linear for {int(expect_fused)} of 1" in report


def test_norm_linear_op_matches_its_parts():
    """The op, on the backend and the reference, is the norm and then the linear: on
    small batches the fused kernel (on a GPU), past them the two kernels."""
    for rows in (1, 40):
        x, residual, norm_weight = rand(rows, 48), rand(rows, 48), rand(48)
        weight, bias = rand(20, 48), rand(20)
        y, normed, h = CUDA.norm_linear(x, residual, norm_weight, 1e-6, weight, bias)
        ref_normed, ref_h = CPU.rms_norm(ref32(x), ref32(norm_weight), 1e-6, ref32(residual))
        check(normed, ref_normed, torch.float32)
        check(h, ref_h, torch.float32)
        check(y, CPU.linear(ref_normed, ref32(weight), ref32(bias)), torch.float32)
        y, normed, h = CUDA.norm_linear(x, None, norm_weight, 1e-6, weight)
        assert h is x
        check(y, CPU.linear(CPU.rms_norm(ref32(x), ref32(norm_weight), 1e-6), ref32(weight)), torch.float32)


# --- RMSNorm -------------------------------------------------------------------------

NORM_SHAPES = matrix([(1, 64), (7, 37), (33, 256), (3, 5, 48)], [(1, 4096), (2048, 4096), (5, 8192)])


@pytest.mark.parametrize("shape, dtype", NORM_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(shape, dtype, with_residual):
    x, weight = rand(*shape, dtype=dtype), rand(shape[-1], dtype=dtype)
    eps = 1e-5
    if not with_residual:
        out = norm.rms_norm(x, weight, eps, out=nan_like(x))
        check(out, CPU.rms_norm(ref32(x), ref32(weight), eps), dtype)
        assert torch.equal(CUDA.rms_norm(x, weight, eps), out)
        return
    residual = rand(*shape, dtype=dtype)
    out, new_residual = norm.rms_norm(x, weight, eps, residual, out=nan_like(x), new_residual=nan_like(x))
    ref_out, ref_residual = CPU.rms_norm(ref32(x), ref32(weight), eps, ref32(residual))
    check(out, ref_out, dtype)
    check(new_residual, ref_residual, dtype)
    api_out, api_residual = CUDA.rms_norm(x, weight, eps, residual)
    assert torch.equal(api_out, out) and torch.equal(api_residual, new_residual)


def test_rms_norm_strided_rows():
    wide = rand(6, 100)
    x = wide[:, 10:74]  # rows 100 apart
    weight = rand(64)
    out = CUDA.rms_norm(x, weight, 1e-6)
    check(out, CPU.rms_norm(ref32(x), ref32(weight), 1e-6), torch.float32)


# --- LayerNorm (vision towers) -----------------------------------------------------

LAYER_NORM_SHAPES = matrix([(1, 64), (7, 37), (33, 1152), (3, 5, 48)], [(4096, 1152), (1024, 4608), (5, 8192)])


@pytest.mark.parametrize("shape, dtype", LAYER_NORM_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_layer_norm(shape, dtype, with_residual):
    # rows off zero mean, so that the centering counts
    x, weight, bias = (
        rand(*shape, dtype=dtype, scale=2.0) + 3,
        rand(shape[-1], dtype=dtype),
        rand(shape[-1], dtype=dtype),
    )
    eps = 1e-6
    if not with_residual:
        check(norm.layer_norm(x, weight, bias, eps), CPU.layer_norm(ref32(x), ref32(weight), ref32(bias), eps), dtype)
        return
    residual = rand(*shape, dtype=dtype)
    out, new_residual = CUDA.layer_norm(x, weight, bias, eps, residual)
    ref_out, ref_residual = CPU.layer_norm(ref32(x), ref32(weight), ref32(bias), eps, ref32(residual))
    check(out, ref_out, dtype)
    check(new_residual, ref_residual, dtype)


def test_layer_norm_strided_rows():
    x = rand(6, 100)[:, 10:74]  # rows 100 apart
    weight, bias = rand(64), rand(64)
    check(
        CUDA.layer_norm(x, weight, bias, 1e-6),
        CPU.layer_norm(ref32(x), ref32(weight), ref32(bias), 1e-6),
        torch.float32,
    )


# --- Rotary --------------------------------------------------------------------------

# (tokens, heads, kv heads, head dim, rotary dim)
ROTARY_CASES = matrix(
    [(1, 4, 1, 64, 64), (5, 8, 2, 64, 32), (17, 4, 4, 128, 128), (3, 2, 1, 256, 64), (6, 3, 1, 80, 40)],
    [(2048, 32, 8, 128, 128), (64, 32, 8, 128, 64)],
)


def cos_sin_cache(max_pos: int, rot_dim: int, base: float = 10000.0) -> Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).float().to(DEVICE)


@pytest.mark.parametrize("case, dtype", ROTARY_CASES)
@pytest.mark.parametrize("with_norms", [False, True], ids=["plain", "head_norms"])
def test_rotary(case, dtype, with_norms):
    tokens, heads, kv_heads, head_dim, rot_dim = case
    # q and k as views into one fused qkv projection, like a model passes them.
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    max_pos = 4096
    cos_sin = cos_sin_cache(max_pos, rot_dim)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    norms = HeadNorms(rand(head_dim, dtype=dtype), rand(head_dim, dtype=dtype), 1e-5) if with_norms else None
    q_before, k_before = q.clone(), k.clone()

    q_out, k_out = rotary.rotary(q, k, positions, cos_sin, norms, q_out=nan_like(q_before), k_out=nan_like(k_before))
    ref_norms = norms and HeadNorms(ref32(norms.q_weight), ref32(norms.k_weight), norms.eps)
    q_ref, k_ref = CPU.rotary(ref32(q), ref32(k), positions.cpu(), cos_sin.cpu(), ref_norms)
    check(q_out, q_ref, dtype)
    check(k_out, k_ref, dtype)
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "wrote its input"

    api_q, api_k = CUDA.rotary(q, k, positions, cos_sin, norms)
    assert torch.equal(api_q, q_out) and torch.equal(api_k, k_out)


@pytest.mark.parametrize("case, dtype", ROTARY_CASES[:6] if not ON_GPU else ROTARY_CASES)
def test_rotary_write_kv(case, dtype):
    """The rotated keys and the values land in the cache at their slots (padding's negative
    slots store nothing, other slots keep what they held); the queries come back rotated."""
    tokens, heads, kv_heads, head_dim, rot_dim = case
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    block_size = 16
    num_blocks = math.ceil(tokens / block_size) + 2
    k_cache, v_cache = (rand(num_blocks, block_size, kv_heads, head_dim, dtype=dtype) for _ in range(2))
    k_before, v_before = k_cache.cpu(), v_cache.cpu()
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots = torch.where(torch.rand(tokens, device=DEVICE) < 0.3, -1, slots)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    cos_sin = cos_sin_cache(4096, rot_dim)
    norms = HeadNorms(rand(head_dim, dtype=dtype), rand(head_dim, dtype=dtype), 1e-5)

    q_out = rotary.rotary_write_kv(q, k, v, positions, cos_sin, norms, k_cache, v_cache, slots)
    ref_norms = HeadNorms(ref32(norms.q_weight), ref32(norms.k_weight), norms.eps)
    q_ref, k_ref = CPU.rotary(ref32(q), ref32(k), positions.cpu(), cos_sin.cpu(), ref_norms)
    check(q_out, q_ref, dtype)
    written = slots.cpu()[slots.cpu() >= 0]
    stored_k, stored_v = (c.cpu().view(-1, kv_heads, head_dim) for c in (k_cache, v_cache))
    check(stored_k[written], k_ref[slots.cpu() >= 0], dtype)
    assert torch.equal(stored_v[written], v.cpu()[slots.cpu() >= 0])
    kept = torch.ones(num_blocks * block_size, dtype=torch.bool)
    kept[written] = False
    assert torch.equal(stored_k[kept], k_before.view(-1, kv_heads, head_dim)[kept])
    assert torch.equal(stored_v[kept], v_before.view(-1, kv_heads, head_dim)[kept])


def test_rotary_write_kv_reads_queries_strided_by_an_output_gate():
    """Queries that are the first half of each head's rows, the output gate the second (Qwen3.5's
    attention), as a view: the same rotated queries as from a contiguous copy."""
    tokens, heads, kv_heads, head_dim, rot_dim, block_size = 5, 4, 2, 64, 32, 16
    q_and_gate = rand(tokens, heads, 2 * head_dim, scale=2.0)
    q = q_and_gate[..., :head_dim]
    k, v = rand(tokens, kv_heads, head_dim), rand(tokens, kv_heads, head_dim)
    caches = [rand(2, block_size, kv_heads, head_dim) for _ in range(2)]
    positions, cos_sin = torch.randint(0, 64, (tokens,), device=DEVICE), cos_sin_cache(64, rot_dim)
    norms = HeadNorms(rand(head_dim), rand(head_dim), 1e-5)
    slots = torch.arange(tokens, device=DEVICE)
    strided = rotary.rotary_write_kv(q, k, v, positions, cos_sin, norms, *caches, slots)
    contiguous = rotary.rotary_write_kv(q.contiguous(), k, v, positions, cos_sin, norms, *caches, slots)
    assert torch.equal(strided, contiguous)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if not ON_GPU else [torch.bfloat16], ids=str)
def test_rotary_attention_op_matches_rotary_then_attention(dtype):
    """The fused op of a step mixing prompt chunks and decodes (and a padding row) against the
    reference's rotary, then store, then attention: the output and the cache it leaves."""
    q_lens, seq_lens = [12, 1, 3, 1, 0], [12, 40, 21, 1, 5]
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    tokens = sum(q_lens)
    k, v = rand(tokens, kv_heads, head_dim, dtype=dtype), rand(tokens, kv_heads, head_dim, dtype=dtype)
    positions = torch.cat([torch.arange(n - q, n) for q, n in zip(q_lens, seq_lens)]).to(DEVICE)
    cos_sin = cos_sin_cache(64, 32)  # partial rotary
    norms = HeadNorms(rand(head_dim, dtype=dtype), rand(head_dim, dtype=dtype), 1e-5)
    cache = LayerKVCache.plain(batch.k_cache, batch.v_cache)
    ref_cache = LayerKVCache.plain(ref32(batch.k_cache), ref32(batch.v_cache))
    m = batch.meta
    ref_meta = AttentionMetadata(m.cu_seqlens_q.cpu(), m.seq_lens.cpu(), m.block_tables.cpu(), m.slot_mapping.cpu(),
                                 m.max_seqlen_q, m.max_seq_len)  # fmt: skip
    ref_norms = HeadNorms(ref32(norms.q_weight), ref32(norms.k_weight), norms.eps)
    ref_rotation = Rotation(positions.cpu(), cos_sin.cpu(), ref_norms)

    out = CUDA.rotary_attention(batch.q, k, v, Rotation(positions, cos_sin, norms), cache, m, 0.125)
    ref = CPU.rotary_attention(ref32(batch.q), ref32(k), ref32(v), ref_rotation, ref_cache, ref_meta, 0.125)
    check(out, ref, dtype)
    for name in ("k", "v"):
        got, want = cache[name].cpu().float(), ref_cache[name]
        assert torch.equal(got.isnan(), want.isnan()), name
        assert rel_err(got.nan_to_num(), want.nan_to_num()) < TOL[dtype], name


# --- Gated activations ---------------------------------------------------------------

# x is [..., 2n]; these are [..., n]
ACT_SHAPES = matrix([(1, 7), (5, 64), (3, 1000), (2, 3, 96)], [(1, 14336), (2048, 14336)])


@pytest.mark.parametrize("shape, dtype", ACT_SHAPES)
@pytest.mark.parametrize("name", ["silu_and_mul", "gelu_tanh_and_mul", "gelu_and_mul"])
def test_act_and_mul(name, shape, dtype):
    x = rand(*shape[:-1], 2 * shape[-1], dtype=dtype, scale=3.0)
    out = getattr(activation, name)(x, out=nan_like(x[..., : shape[-1]].contiguous()))
    check(out, getattr(CPU, name)(ref32(x)), dtype)
    assert torch.equal(getattr(CUDA, name)(x), out)


@pytest.mark.parametrize("shape, dtype", matrix([(1, 7), (3, 1000)], [(1, 4096), (256, 4096)]))
def test_sigmoid_gate(shape, dtype):
    """An attention's output gate: the gate a view with a row stride (as q's projection holds it)."""
    tokens, n = shape
    y = rand(tokens, n, dtype=dtype)
    gate = rand(tokens, 2 * n, dtype=dtype, scale=3.0)[:, n:]
    out = activation.sigmoid_gate(y, gate)
    assert out.shape == (tokens, n)
    check(out, torch.sigmoid(ref32(gate)) * ref32(y), dtype)
    assert torch.equal(CUDA.sigmoid_gate(y, gate), out)


# (tokens, hidden, the gate's input width): odd widths, a row wider than a program's block, and Qwen3.6's 2048
ADD_GATED_CASES = matrix([(1, 7, 5), (3, 1000, 1500), (2, 5000, 64)], [(1, 2048, 2048), (256, 2048, 2048)])


@pytest.mark.parametrize("case, dtype", ADD_GATED_CASES)
def test_add_gated(case, dtype):
    """A shared expert's output scaled by its gate (the one-row projection computed in the kernel) and
    added to the routed experts': ``y`` a view with a row stride."""
    tokens, n, k = case
    base, x = rand(tokens, n, dtype=dtype), rand(tokens, k, dtype=dtype)
    y = rand(tokens, n + 5, dtype=dtype)[:, 2 : 2 + n]
    gate_weight = rand(1, k, dtype=dtype, scale=2 / k**0.5)
    out = activation.add_gated(base, y, x, gate_weight)
    assert out.shape == (tokens, n)
    check(out, ref32(base) + torch.sigmoid(ref32(x) @ ref32(gate_weight).T) * ref32(y), dtype)
    assert torch.equal(CUDA.add_gated(base, y, x, gate_weight), out)


# --- KV cache write ------------------------------------------------------------------

# (tokens, kv heads, head dim, block size, blocks)
KV_WRITE_CASES = matrix(
    [(9, 2, 64, 16, 6), (5, 1, 128, 8, 4), (12, 4, 32, 32, 3), (7, 3, 80, 16, 2)],
    [(2048, 8, 128, 16, 300), (33, 4, 256, 64, 10)],
)


@pytest.mark.parametrize("case, dtype", KV_WRITE_CASES)
def test_write_kv(case, dtype):
    check_write_kv(case, dtype, dtype)


def test_write_kv_casts_to_cache_dtype():
    check_write_kv((9, 2, 64, 16, 6), torch.float32, torch.float16)


def check_write_kv(case, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    tokens, kv_heads, head_dim, block_size, num_blocks = case
    k, v = rand(tokens, kv_heads, head_dim, dtype=dtype), rand(tokens, kv_heads, head_dim, dtype=dtype)
    k_cache = rand(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    v_cache = rand(num_blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    padding = torch.rand(tokens, device=DEVICE) < 0.3
    slots = torch.where(padding, -1 - torch.randint(0, 5, (tokens,), device=DEVICE), slots)
    k_ref, v_ref = k_cache.cpu(), v_cache.cpu()  # copies
    CPU.write_kv(k.cpu(), v.cpu(), LayerKVCache.plain(k_ref, v_ref), slots.cpu())
    CUDA.write_kv(k, v, LayerKVCache.plain(k_cache, v_cache), slots)
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)


def test_write_kv_strided_views():
    tokens, kv_heads, head_dim = 6, 2, 64
    kv = rand(tokens, 2, kv_heads, head_dim)  # K and V interleaved per token
    k_cache, v_cache = rand(4, 8, kv_heads, head_dim), rand(4, 8, kv_heads, head_dim)
    slots = torch.tensor([3, -1, 8, 31, 0, 17], device=DEVICE)
    k_ref, v_ref = k_cache.cpu(), v_cache.cpu()
    CPU.write_kv(kv[:, 0].cpu(), kv[:, 1].cpu(), LayerKVCache.plain(k_ref, v_ref), slots.cpu())
    CUDA.write_kv(kv[:, 0], kv[:, 1], LayerKVCache.plain(k_cache, v_cache), slots)
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)


# --- Attention -----------------------------------------------------------------------


@dataclass
class Batch:
    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    meta: AttentionMetadata

    def reference(self, scale: float, window: int | None, softcap: float | None) -> Tensor:
        m = self.meta
        meta = AttentionMetadata(
            m.cu_seqlens_q.cpu(), m.seq_lens.cpu(), m.block_tables.cpu(),
            m.slot_mapping.cpu(), m.max_seqlen_q, m.max_seq_len,
        )  # fmt: skip
        q, k, v = ref32(self.q), ref32(self.k_cache), ref32(self.v_cache)
        return CPU.attend(q, LayerKVCache.plain(k, v), meta, scale, window, softcap)


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> Batch:
    """Random caches and queries; each sequence's blocks scattered over the pool.

    Cache slots no sequence owns (a spare block every block table points at past its
    end, and the tail of each last block) hold NaN: reading one shows in the output.
    """
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    poison = sum(blocks_per_seq)
    num_blocks = poison + 1
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = rand(*shape, dtype=dtype), rand(*shape, dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(blocks_per_seq) + 1), poison, dtype=torch.int32)
    order = torch.randperm(poison)
    used = 0
    for b, (seq_len, n) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[b, :n] = order[used : used + n]
        used += n
        if n and seq_len % block_size:
            k_cache[block_tables[b, n - 1], seq_len % block_size :] = float("nan")
            v_cache[block_tables[b, n - 1], seq_len % block_size :] = float("nan")
    k_cache[poison], v_cache[poison] = float("nan"), float("nan")

    slots = []
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_tables[b, pos // block_size]) * block_size + pos % block_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        max_seqlen_q=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    q = rand(sum(q_lens), heads, head_dim, dtype=dtype)
    return Batch(q, k_cache, v_cache, meta)


def run_attention(batch: Batch, scale, window=None, softcap=None, **overrides) -> Tensor:
    return attention.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.meta, scale, window, softcap,
        out=nan_like(batch.q), **overrides,
    )  # fmt: skip


# name: (q_lens, seq_lens, heads, kv heads, head dim, block size)
PREFILL_SMALL = {
    "prefill_odd": ([37], [37], 4, 1, 64, 16),
    "prefill_gqa8_bs8": ([19], [19], 8, 1, 64, 8),
    "prefix_cached": ([5], [40], 4, 2, 64, 16),
    "chunked_two_seqs": ([16, 7], [16, 45], 4, 4, 64, 32),
    "mixed_prefill_decode": ([23, 1, 4, 1, 9], [23, 17, 30, 1, 50], 8, 2, 64, 16),
    "d32": ([9, 3], [9, 12], 4, 2, 32, 16),
    "d128": ([13, 1], [13, 29], 4, 1, 128, 16),
    "d256": ([6, 1], [11, 20], 2, 1, 256, 8),
    "d96_gqa3": ([10], [14], 6, 2, 96, 16),
}
PREFILL_LARGE = {
    "llama_prefill_2048": ([2048], [2048], 32, 8, 128, 16),
    "llama_prefix_300_of_2000": ([300], [2000], 32, 8, 128, 16),
    "llama_mixed": ([500, 1, 1, 77, 1], [500, 3000, 9, 1200, 1], 32, 8, 128, 16),
    "d256_prefill_513": ([513, 64], [513, 900], 16, 8, 256, 32),
    "d64_mha": ([300], [300], 12, 12, 64, 64),
}
PREFILL_CASES = PREFILL_SMALL | (PREFILL_LARGE if ON_GPU else {})
LOW_PRECISION = [torch.float16, torch.bfloat16]


@pytest.mark.parametrize("name, dtype", matrix(list(PREFILL_SMALL), list(PREFILL_LARGE), LOW_PRECISION))
def test_attention_prefill(name, dtype):
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size = PREFILL_CASES[name]
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    check(run_attention(batch, scale), batch.reference(scale, None, None), dtype)


WINDOW_CASES = ["llama_mixed"] if ON_GPU else ["prefix_cached", "mixed_prefill_decode"]


@pytest.mark.parametrize("window, softcap", [(1, None), (7, None), (20, None), (None, 5.0), (1, 5.0), (7, 5.0)])
@pytest.mark.parametrize("name", WINDOW_CASES)
def test_attention_prefill_window_softcap(name, window, softcap):
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size = PREFILL_CASES[name]
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    window = window * 30 if window and ON_GPU else window
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    # A large scale, so that the softcap changes the scores.
    out = run_attention(batch, 0.5, window, softcap)
    check(out, batch.reference(0.5, window, softcap), dtype)


# name: (seq_lens, heads, kv heads, head dim, block size); one query per sequence
DECODE_SMALL = {
    "decode_gqa4": ([1, 17, 64, 130], 4, 1, 64, 16),
    "decode_mha_bs8": ([33, 9], 4, 4, 64, 8),
    "decode_gqa8_d128": ([70, 200], 8, 1, 128, 32),
    "decode_d256": ([40, 3], 2, 1, 256, 16),
}
DECODE_LARGE = {
    "llama_b1_1k": ([1024], 32, 8, 128, 16),
    "llama_b1_32k": ([32768], 32, 8, 128, 16),
    "llama_b8_mixed": ([8192, 1, 5000, 17, 2049, 100, 3333, 64], 32, 8, 128, 16),
    "d256_gqa2": ([4097, 300], 16, 8, 256, 32),
}
DECODE_CASES = DECODE_SMALL | (DECODE_LARGE if ON_GPU else {})


# On a GPU the automatic split counts of the large cases stand in for a forced 4 (merged by the
# last split program) and 16 (merged by the reduce launch).
@pytest.mark.parametrize("num_splits", [None, 1] + ([] if ON_GPU else [4, 16]), ids=lambda s: f"splits{s or 'auto'}")
@pytest.mark.parametrize("name, dtype", matrix(list(DECODE_SMALL), list(DECODE_LARGE), LOW_PRECISION))
def test_attention_decode(name, dtype, num_splits):
    seq_lens, heads, kv_heads, head_dim, block_size = DECODE_CASES[name]
    batch = make_batch([1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = run_attention(batch, scale, num_splits=num_splits)
    check(out, batch.reference(scale, None, None), dtype)


@pytest.mark.parametrize("window", [1, 5, 100])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_decode_window_softcap(window, softcap):
    seq_lens = [1, 17, 64, 130] + ([5000, 9000] if ON_GPU else [])
    window = window * 30 if ON_GPU else window
    batch = make_batch([1] * len(seq_lens), seq_lens, 8, 2, 64, 16, torch.float32)
    out = run_attention(batch, 0.5, window, softcap, num_splits=4)
    check(out, batch.reference(0.5, window, softcap), torch.float32)


def test_attention_decode_few_splits_merge_without_the_reduce(monkeypatch):
    """Up to MERGE_SPLITS splits the last program of each (sequence, KV head) merges the
    partials, with no reduce launch, and leaves its counter at zero for the next layer."""
    monkeypatch.setattr(attention, "_decode_reduce_kernel", _NoLaunch())
    batch = make_batch([1, 0, 1, 1], [300, 7, 90, 1], 8, 2, 64, 16, torch.float32)
    for layer in range(2):
        out = run_attention(batch, 0.125, num_splits=attention.MERGE_SPLITS)
        check(out, batch.reference(0.125, None, None), torch.float32)
        assert int(arrivals.counters(DEVICE, "attention", 1).abs().sum()) == 0, layer


@pytest.mark.parametrize("num_splits", [attention.MERGE_SPLITS, 16])
def test_attention_decode_reads_only_the_parts_that_ran(monkeypatch, num_splits):
    """A graph's split count comes from its longest context: a short context fills only the
    splits its keys need, the grid's other programs exit, and the merge (by the last split
    where a context filled up to MERGE_SPLITS, by the reduce launch past it: here the 700
    keys' 11 splits of 64) reads only the parts written, and leaves the counters at zero.
    Every buffer the call allocates starts as poison (NaN, or -1 for counts)."""
    empty = torch.empty

    def poisoned(*shape, **kwargs):
        t = empty(*shape, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    batch = make_batch([1, 1, 0, 1, 1], [300, 7, 20, 65, 700], 8, 2, 64, 16, torch.float32)
    arrivals.counters(DEVICE, "attention", 1)  # (allocated before the poison)
    monkeypatch.setattr(torch, "empty", poisoned)
    out = run_attention(batch, 0.125, num_splits=num_splits)
    monkeypatch.undo()
    check(out, batch.reference(0.125, None, None), torch.float32)
    assert int(arrivals.counters(DEVICE, "attention", 1).abs().sum()) == 0


class _NoLaunch:
    """A kernel stand-in that fails when launched."""

    def __getitem__(self, grid):
        raise AssertionError("the reduce kernel launched")


def test_attention_decode_skips_empty_sequences():
    """Sequences with no query this step (padding of a fixed-size decode batch)."""
    batch = make_batch([1, 0, 1, 0], [20, 7, 90, 1], 4, 2, 64, 16, torch.float32)
    for num_splits in (1, 4):
        out = run_attention(batch, 0.125, num_splits=num_splits)
        check(out, batch.reference(0.125, None, None), torch.float32)


def test_attention_decode_grid_ignores_context_lengths():
    """The decode launch reads the context lengths inside the kernel only: growing them
    in place (as a replayed CUDA graph sees them) needs no new launch parameters."""
    batch = make_batch([1, 1, 1], [100, 37, 250], 4, 1, 64, 16, torch.float32)
    meta = batch.meta
    seq_lens = meta.seq_lens.clone()
    shorter = torch.tensor([60, 1, 129], dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(batch.q)

    def step():
        attention.paged_attention(batch.q, batch.k_cache, batch.v_cache, meta, 0.125, out=out)

    if ON_GPU:
        step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run = graph.replay
    else:
        run = step
    for lens in (shorter, seq_lens):
        meta.seq_lens.copy_(lens)
        out.fill_(float("nan"))
        run()
        if ON_GPU:
            torch.cuda.synchronize()
        check(out, batch.reference(0.125, None, None), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_then_attention_mixed_batch(dtype):
    """One step as the engine runs it: this step's K/V written, then attention."""
    q_lens, seq_lens = [12, 1, 3, 1], [12, 40, 21, 1]
    if ON_GPU:
        q_lens, seq_lens = [700, 1, 1, 33], [700, 4000, 2, 1500]
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    num_tokens = sum(q_lens)
    k, v = rand(num_tokens, kv_heads, head_dim, dtype=dtype), rand(num_tokens, kv_heads, head_dim, dtype=dtype)
    cpu_batch = Batch(batch.q, batch.k_cache.cpu(), batch.v_cache.cpu(), batch.meta)
    CPU.write_kv(
        k.cpu(), v.cpu(), LayerKVCache.plain(cpu_batch.k_cache, cpu_batch.v_cache), batch.meta.slot_mapping.cpu()
    )
    CUDA.write_kv(k, v, LayerKVCache.plain(batch.k_cache, batch.v_cache), batch.meta.slot_mapping)
    assert torch.allclose(batch.k_cache.cpu(), cpu_batch.k_cache, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(batch.v_cache.cpu(), cpu_batch.v_cache, rtol=0, atol=0, equal_nan=True)
    out = CUDA.attend(batch.q, LayerKVCache.plain(batch.k_cache, batch.v_cache), batch.meta, 0.125)
    check(out, cpu_batch.reference(0.125, None, None), dtype)


@pytest.mark.skipif(ON_GPU, reason="on a GPU these are the tiles in use")
@pytest.mark.parametrize("block_size", [8, 16, 128])
def test_attention_gpu_tile_shapes(block_size):
    """The GPU's tile shapes: a key tile spanning several cache blocks, or inside one."""
    batch = make_batch([23, 1, 40, 1], [23, 150, 61, 9], 8, 2, 64, block_size, torch.float32)
    decode = make_batch([1, 1, 1], [150, 1, 300], 8, 1, 64, block_size, torch.float32)
    for window in (None, 19):
        ref = batch.reference(0.125, window, None)
        for tiles in (attention.TileConfig(64, 32, 4, 1), attention.TileConfig(128, 64, 8, 2)):
            check(run_attention(batch, 0.125, window, prefill_tiles=tiles), ref, torch.float32)
        out = run_attention(decode, 0.125, window, decode_tiles=attention.TileConfig(16, 64, 4, 2), num_splits=2)
        check(out, decode.reference(0.125, window, None), torch.float32)
