"""The Metal backend's ops against the plain-torch reference (``TorchOps``) on random
inputs, on Apple silicon: the KV write of every format it declares (the stored codes
within one level, the scales), and paged attention over the block table, prefill and
decode, with GQA, a sliding window, a softcap and key limits, reading each format in place; then the
attention op (store, then attend) end to end. Elsewhere every test here is skipped."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.backends.metal_cases import paged_case
from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata
from xinfer.torch_ops import TorchOps
from xinfer_metal.ops import MetalOps

pytestmark = pytest.mark.skipif(
    not torch.backends.mps.is_available(), reason="Metal kernels run on Apple silicon only: no mps device here"
)
MPS = torch.device("mps")
REFERENCE, METAL = TorchOps(), MetalOps()
FORMATS = sorted(MetalOps.kv_formats)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.2e-2}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def on_cpu(cache: LayerKVCache) -> LayerKVCache:
    def cpu(t):
        return t.cpu() if t is not None else None

    tensors = {n: t.cpu() for n, t in cache.tensors.items()}
    return LayerKVCache(cache.format, tensors, cache.head_dim, cache.dtype, cpu(cache.equalizer), cpu(cache.key_offset))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_write_stores_what_the_reference_stores(fmt, dtype, head_dim):
    """The same bytes but where a value sits on a rounding boundary (Metal's division may
    differ from torch's in the last bit): codes at most one level apart, decoding alike."""
    cache, k, v, slots, _ = paged_case(fmt, dtype, head_dim, [37, 20, 9], [1, 1, 1], MPS)
    METAL.write_kv(k, v, cache, slots)
    want = on_cpu(cache)
    for t in want.tensors.values():
        t.zero_()
    REFERENCE.write_kv(k.cpu(), v.cpu(), want, slots.cpu())
    got = on_cpu(cache)
    for name, tensor in want.tensors.items():
        if name.endswith("_scale"):
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=0)  # rotated on the GPU
        elif tensor.dtype == torch.uint8 and fmt != "auto":
            differs = (got[name] != tensor).float().mean()
            assert differs < 1e-3, (name, differs)
        else:
            assert torch.equal(got[name], tensor), name
    k_got, v_got = got.format.decode(got.tensors)
    k_want, v_want = want.format.decode(want.tensors)
    assert relative_error(k_got, k_want) < 1e-3 and relative_error(v_got, v_want) < 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_over_the_cache_matches_the_reference(fmt, dtype, head_dim):
    """Prefill (chunked: the queries are the last part of each context) and decode, with
    4 query heads on 2 KV heads, against the reference over the same stored cache."""
    cache, k, v, slots, meta = paged_case(fmt, dtype, head_dim, [37, 20, 9], [5, 20, 1], MPS)
    stored = on_cpu(cache)  # written by the reference (on the CPU: it casts to float8, which mps may lack)
    REFERENCE.write_kv(k.cpu(), v.cpu(), stored, slots.cpu())
    for name, tensor in stored.tensors.items():
        cache[name].copy_(tensor)
    scale = head_dim**-0.5
    decode = AttentionMetadata(
        torch.arange(4, dtype=torch.int32, device=MPS), meta.seq_lens, meta.block_tables,
        torch.full((3,), -1, dtype=torch.int64, device=MPS), 1, meta.max_seq_len,
    )  # fmt: skip
    for step in (meta, decode):
        q = torch.randn(int(step.cu_seqlens_q[-1]), 4, head_dim).to(dtype)
        cpu_step = AttentionMetadata(*(t.cpu() for t in (step.cu_seqlens_q, step.seq_lens, step.block_tables,
                                      step.slot_mapping)), step.max_seqlen_q, step.max_seq_len)  # fmt: skip
        for window, softcap in ((None, None), (6, None), (None, 30.0)):
            want = REFERENCE.attend(q.float(), stored, cpu_step, scale, window, softcap)
            got = METAL.attend(q.to(MPS), cache, step, scale, window, softcap)
            assert got.dtype == dtype and got.shape == q.shape
            assert relative_error(got, want) < TOL[dtype], (step.max_seqlen_q, window, softcap)


def test_key_limits_let_a_query_see_later_keys():
    cache, k, v, slots, meta = paged_case("turbo4", torch.float16, 128, [12], [8], MPS)
    stored = on_cpu(cache)
    REFERENCE.write_kv(k.cpu(), v.cpu(), stored, slots.cpu())
    for name, tensor in stored.tensors.items():
        cache[name].copy_(tensor)
    positions = torch.arange(4, 12, dtype=torch.int32)
    limits = torch.where((positions >= 5) & (positions < 9), 8, positions)
    q = torch.randn(8, 4, 128).to(torch.float16)
    cpu_meta = AttentionMetadata(*(t.cpu() for t in (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                   meta.slot_mapping)), meta.max_seqlen_q, meta.max_seq_len, key_limits=limits)  # fmt: skip
    meta.key_limits = limits.to(MPS)
    want = REFERENCE.attend(q.float(), stored, cpu_meta, 0.125)
    assert relative_error(METAL.attend(q.to(MPS), cache, meta, 0.125), want) < TOL[torch.float16]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_attention_op_stores_the_step_then_attends(fmt):
    """One prefill step through the op, as the model calls it: its K/V stored at the step's
    slots, then read back by the step's own queries."""
    dtype, head_dim = torch.float16, 128
    cache, k, v, slots, meta = paged_case(fmt, dtype, head_dim, [24, 10], [24, 10], MPS)
    meta.slot_mapping = slots
    q = torch.randn(34, 4, head_dim).to(dtype)
    reference = on_cpu(cache)
    cpu_meta = AttentionMetadata(*(t.cpu() for t in (meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                   meta.slot_mapping)), meta.max_seqlen_q, meta.max_seq_len)  # fmt: skip
    want = REFERENCE.attention(q.float(), k.cpu().float(), v.cpu().float(), reference, cpu_meta, head_dim**-0.5)
    got = METAL.attention(q.to(MPS), k, v, cache, meta, head_dim**-0.5)
    assert relative_error(got, want) < 2e-2  # each side stored from its own dtype's K/V
