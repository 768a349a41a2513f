"""The Metal kernels' source run on the CPU (tests/backends/metal_emulator.py: compiled as
C++ against a stand-in for the Metal standard library, one CPU thread per GPU thread),
through the backend's own ops, against the torch reference: the write stores exactly the
reference's bytes, and attention (prefill and decode, GQA, sliding window, softcap, key
limits) matches the reference over the same cache. What this cannot show, Apple's compiler
taking the source and the kernels' speed, needs a Mac (test_metal_kernels.py)."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.backends.metal_cases import paged_case
from tests.backends.metal_emulator import COMPILER, EmulatedLibrary
from xinfer.ops import AttentionMetadata
from xinfer.torch_ops import TorchOps
from xinfer_metal.kernels import attention, kv_write
from xinfer_metal.ops import MetalOps

pytestmark = pytest.mark.skipif(COMPILER is None, reason="emulating the Metal kernels needs g++ (C++20)")
CPU = torch.device("cpu")
REFERENCE, METAL = TorchOps(), MetalOps()
# each format once or more, each dtype read by the plain codecs (the codes do not depend on it)
CASES = [("auto", torch.float32), ("auto", torch.float16), ("auto", torch.bfloat16),
         ("fp8", torch.float16), ("turbo8", torch.bfloat16), ("turbo4", torch.float32)]  # fmt: skip
CASE_IDS = [f"{f}-{str(d)[6:]}" for f, d in CASES]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # the output's rounding to its dtype


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    build = tmp_path_factory.mktemp("metal")
    return {library: EmulatedLibrary(library, build) for library in (kv_write.LIBRARY, attention.LIBRARY)}


@pytest.fixture(autouse=True)
def emulated(compiled, monkeypatch, request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    for library, emulator in compiled.items():
        monkeypatch.setattr(library, "compiled", emulator)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("fmt, dtype", CASES, ids=CASE_IDS)
def test_the_write_stores_the_references_bytes(fmt, dtype):
    """Every byte and scale as the reference stores it: the codes round alike (fp8 to nearest
    even, uniform codes by rint), the slots land in the right blocks, padding is skipped."""
    cache, k, v, slots, _ = paged_case(fmt, dtype, 64, [13, 6], [1, 1], CPU)
    slots[3] = -1  # padding
    want = paged_case(fmt, dtype, 64, [13, 6], [1, 1], CPU)[0]
    want.key_offset, want.equalizer = cache.key_offset, cache.equalizer
    METAL.write_kv(k, v, cache, slots)
    REFERENCE.write_kv(k, v, want, slots)
    for name, tensor in want.tensors.items():
        assert torch.equal(cache[name], tensor), name


def test_fp8_rounds_ties_subnormals_and_the_largest_value_as_torch_does():
    """Values on e4m3's rounding ties, in its subnormal range and at the scale's top."""
    cache, *_ = paged_case("fp8", torch.float32, 64, [1], [1], CPU)
    cache.key_offset = cache.equalizer = None
    grid = torch.tensor([448.0, -448.0, 1.0, 1.0625, 1.1875, 2**-7, 3 * 2**-10, 2**-10, 0.0, -0.0, 2**-6 * 0.9375])
    k = torch.cat([grid, torch.linspace(-3, 3, 64 - len(grid))]).view(1, 1, 64).expand(1, 2, 64).contiguous()
    want = paged_case("fp8", torch.float32, 64, [1], [1], CPU)[0]
    want.key_offset = want.equalizer = None
    slots = torch.zeros(1, dtype=torch.int64)
    METAL.write_kv(k, k, cache, slots)
    REFERENCE.write_kv(k, k, want, slots)
    for name in ("k", "v", "k_scale", "v_scale"):
        assert torch.equal(cache[name], want[name]), name


def cpu_metadata(meta: AttentionMetadata, **changes) -> AttentionMetadata:
    fields = dict(vars(meta)) | changes
    return AttentionMetadata(**fields)


@pytest.mark.parametrize("fmt, dtype", CASES, ids=CASE_IDS)
def test_attention_matches_the_reference_over_the_same_cache(fmt, dtype):
    """A chunked prefill (the queries are the last part of each context) and a decode step
    (keys split over 8 simdgroups), 4 query heads on 2 KV heads, plain and windowed with a softcap."""
    cache, k, v, slots, meta = paged_case(fmt, dtype, 64, [21, 9], [5, 9], CPU)
    REFERENCE.write_kv(k, v, cache, slots)
    decode = cpu_metadata(meta, cu_seqlens_q=torch.arange(3, dtype=torch.int32), max_seqlen_q=1,
                          slot_mapping=torch.full((2,), -1, dtype=torch.int64))  # fmt: skip
    for step in (meta, decode):
        q = torch.randn(int(step.cu_seqlens_q[-1]), 4, 64).to(dtype)
        for window, softcap in ((None, None), (6, 20.0)):
            want = REFERENCE.attend(q, cache, step, 0.125, window, softcap)
            got = METAL.attend(q, cache, step, 0.125, window, softcap)
            assert got.dtype == dtype
            assert relative_error(got, want) < TOL[dtype], (step.max_seqlen_q, window, softcap)


def test_key_limits_let_a_query_see_later_keys():
    """An image's tokens attend to each other both ways: query i sees keys up to key_limits[i]."""
    cache, k, v, slots, meta = paged_case("turbo4", torch.float32, 64, [12], [8], CPU)
    REFERENCE.write_kv(k, v, cache, slots)
    positions = torch.arange(4, 12, dtype=torch.int32)
    limited = cpu_metadata(meta, key_limits=torch.where((positions >= 5) & (positions < 9), 8, positions))
    q = torch.randn(8, 4, 64)
    want = REFERENCE.attend(q, cache, limited, 0.125)
    assert relative_error(METAL.attend(q, cache, limited, 0.125), want) < TOL[torch.float32]
    assert relative_error(METAL.attend(q, cache, meta, 0.125), want) > 0.05  # the limits matter here


@pytest.mark.parametrize("fmt", ["auto", "turbo8"])
def test_the_attention_op_stores_the_step_then_attends(fmt):
    cache, k, v, slots, meta = paged_case(fmt, torch.float16, 64, [16, 7], [16, 7], CPU)
    meta.slot_mapping = slots
    want_cache = paged_case(fmt, torch.float16, 64, [16, 7], [16, 7], CPU)[0]
    want_cache.key_offset, want_cache.equalizer = cache.key_offset, cache.equalizer
    q = torch.randn(23, 4, 64).to(torch.float16)
    want = REFERENCE.attention(q, k, v, want_cache, meta, 0.125)
    assert relative_error(METAL.attention(q, k, v, cache, meta, 0.125), want) < TOL[torch.float16]
