"""The CUDA backend's quantized KV formats against the plain-torch reference (``TorchOps``):
the write kernel stores what ``KVFormat.quantize`` stores (bit for bit but for
scales on the RMS, whose sum may round differently), and attention that decodes
tiles in registers matches the reference attention over the same stored cache.

Runs on the device ``XINFER_KERNEL_DEVICE`` picks (see tests/conftest.py): under the Triton
interpreter on CPU, small shapes in fp32 and fp16.
"""

from __future__ import annotations

import itertools
import math
import os
import zlib
from dataclasses import astuple, replace

import pytest
import torch

from xinfer.kv import KVFormat, LayerKVCache, get_format
from xinfer.kv.codecs import Codec, Fp8
from xinfer.ops import AttentionMetadata, ShadowPages
from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import attention
from xinfer_cuda.ops import CudaOps

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
FORMATS = ["fp8", "turbo8", "turbo4", "turbo3", "turbo4-lm", "turbo3-lm"]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 1.2e-2}
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

CPU, CUDA = TorchOps(), CudaOps()


def test_the_backend_declares_the_formats_tested_here():
    assert CudaOps.kv_formats == {"auto", *FORMATS}


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def to_cpu(cache: LayerKVCache) -> LayerKVCache:
    def cpu(t):
        return t.cpu() if t is not None else None

    tensors = {n: t.cpu() for n, t in cache.tensors.items()}
    return LayerKVCache(cache.format, tensors, cache.head_dim, cache.dtype, cpu(cache.equalizer), cpu(cache.key_offset))


def _scales_by_rms(codec: Codec) -> bool:
    return getattr(codec, "scales_by_rms", False)


def assert_same_storage(got: LayerKVCache, want: LayerKVCache) -> None:
    # Rotated sides come from exact products summed in fp32 in another order than the
    # reference's matmul, Lloyd–Max RMS scales from a sum that may round differently,
    # and a GPU's fp32 division is not correctly rounded: values on a rounding boundary
    # may take the neighbouring code there.
    fmt = want.format
    inexact = {
        "k": fmt.rotate_keys or _scales_by_rms(fmt.key),
        "v": fmt.rotate_values or _scales_by_rms(fmt.value),
    }
    for name, tensor in want.tensors.items():
        side_inexact = inexact[name[0]]
        if name.endswith("scale") and side_inexact:
            torch.testing.assert_close(got[name].cpu(), tensor, rtol=2e-3 if ON_GPU else 1e-5, atol=0)
        elif name.endswith("scale"):
            assert torch.equal(got[name].cpu(), tensor), name
        else:
            allowed = 0.001 if side_inexact or ON_GPU else 0
            mismatched = (got[name].cpu() != tensor).float().mean().item()
            assert mismatched <= allowed, (name, mismatched)


def write_case(
    fmt: str, dtype: torch.dtype, head_dim: int, seq_lens: list[int], q_lens: list[int], block_size: int = 8
):
    """Caches holding ``seq_lens`` tokens per sequence, written by both backends, and the
    metadata of a step whose queries are the last ``q_lens`` of each."""
    kv_format = get_format(fmt)
    kv_heads = 2
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    order = torch.randperm(num_blocks - 1)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    slots, used = [], 0
    for b, (n, s) in enumerate(zip(blocks_per_seq, seq_lens)):
        tables[b, :n] = order[used : used + n]
        used += n
        slots += [int(tables[b, p // block_size]) * block_size + p % block_size for p in range(s)]
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    total = len(slots)
    k = (torch.randn(total, kv_heads, head_dim) * 2).to(dtype)
    v = torch.randn(total, kv_heads, head_dim).to(dtype)
    k[: total // 3, :, :3] *= 10  # outlier channels, as real keys have
    reference = kv_format.allocate(num_blocks, block_size, kv_heads, head_dim, dtype, torch.device("cpu"))
    device_cache = kv_format.allocate(num_blocks, block_size, kv_heads, head_dim, dtype, DEVICE)
    if kv_format.rotate_keys:  # calibrated key transforms, as the engine sets them
        reference.key_offset = torch.randn(kv_heads, head_dim)
        device_cache.key_offset = reference.key_offset.to(DEVICE)
        reference.equalizer = torch.rand(kv_heads, head_dim) + 0.5
        device_cache.equalizer = reference.equalizer.to(DEVICE)
    CPU.write_kv(k, v, reference, slot_mapping)
    CUDA.write_kv(k.to(DEVICE), v.to(DEVICE), device_cache, slot_mapping.to(DEVICE))
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.full((sum(q_lens),), -1, dtype=torch.int64),
        max_seqlen_q=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return reference, device_cache, meta


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    shadows = ShadowPages(*(t.to(DEVICE) for t in astuple(meta.shadows))) if meta.shadows is not None else None
    return AttentionMetadata(
        meta.cu_seqlens_q.to(DEVICE), meta.seq_lens.to(DEVICE), meta.block_tables.to(DEVICE),
        meta.slot_mapping.to(DEVICE), meta.max_seqlen_q, meta.max_seq_len, shadows,
    )  # fmt: skip


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.cpu().double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("seq_lens", [[13, 5], [300, 40]], ids=["decode_tiles", "prefill_tiles"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_write_matches_reference(fmt, head_dim, seq_lens):
    dtype = torch.float16 if ON_GPU else torch.float32
    reference, device_cache, _ = write_case(fmt, dtype, head_dim, seq_lens, [1, 1])
    assert_same_storage(device_cache, reference)


def test_fp8_write_rounds_subnormals_and_ties_like_torch():
    from xinfer_cuda.kernels.kv_quant_write import quant_write_kv

    fmt = KVFormat("e4m3", Fp8(), Fp8())  # the codec alone: fp8 rotates its keys
    head_dim = 64
    x = torch.randn(3, 1, head_dim)
    x[0, 0, 0] = 448.0  # scale 1: values land on e4m3 as they are
    x[0, 0, 1:9] = torch.tensor([2**-10, 3 * 2**-10, 2**-9, 1.5 * 2**-9, 0.0019, 1.0625, 1.1875, -3 * 2**-10])
    x[1] *= 1e-3
    cache = fmt.allocate(1, 4, 1, head_dim, torch.float32, DEVICE)
    slots = torch.arange(3, device=DEVICE)
    quant_write_kv(x.to(DEVICE), -x.to(DEVICE), cache, slots)
    want = fmt.quantize(x, -x)
    assert torch.equal(cache["k"][0, :3].cpu(), want["k"])
    assert torch.equal(cache["v"][0, :3].cpu(), want["v"])


# Each format at each head dim and dtype on a GPU; a spread of them in the interpreter.
# Head dim 16 (tiny test models) is narrower than one slice of the rotation.
ATTENTION_CASES = (
    [(f, d, t) for f in FORMATS for d in (64, 128, 256) for t in DTYPES]
    if ON_GPU
    else [(f, 64, torch.float32) for f in FORMATS]
    + [
        ("turbo4", 128, torch.float16),
        ("turbo8", 128, torch.float32),
        ("turbo3", 256, torch.float16),
        ("fp8", 256, torch.float16),
        ("turbo3", 128, torch.float32),
    ]
) + [("turbo4", 16, torch.float32), ("turbo3", 16, torch.float16)]


@pytest.mark.parametrize(
    "fmt, head_dim, dtype", [pytest.param(*c, id=f"{c[0]}-{c[1]}-{str(c[2])[6:]}") for c in ATTENTION_CASES]
)
def test_attention_over_quantized_cache(fmt, head_dim, dtype):
    """A prefill step (chunked: queries are the last part of each context) and decode
    steps with one and several splits, all against the reference attention over the
    same stored cache (the write is checked on its own above)."""
    _, device_cache, meta = write_case(fmt, dtype, head_dim, [37, 20, 9], [5, 20, 1])
    reference = to_cpu(device_cache)
    heads = 4
    scale = head_dim**-0.5
    q = torch.randn(int(meta.cu_seqlens_q[-1]), heads, head_dim).to(dtype)
    want = CPU.attend(q.float(), reference, meta, scale)
    got = CUDA.attend(q.to(DEVICE), device_cache, on_device(meta), scale)
    assert relative_error(got, want) < TOL[dtype]

    decode = AttentionMetadata(
        torch.arange(4, dtype=torch.int32), meta.seq_lens, meta.block_tables,
        torch.full((3,), -1, dtype=torch.int64), 1, meta.max_seq_len,
    )  # fmt: skip
    q1 = torch.randn(3, heads, head_dim).to(dtype)
    want1 = CPU.attend(q1.float(), reference, decode, scale, softcap=30.0)
    # also the long tiles that batches filling a GPU's multiprocessors get (the interpreter would take its own
    # tiles: it is given the GPU's, at one split count)
    if ON_GPU:
        long_tiles, long_splits = attention.decode_config(head_dim, q1.to(DEVICE), long_tiles=True), (1, 4, 32)
    else:
        table = attention._LONG_DECODE_TILES
        long_tiles, long_splits = table[min(d for d in table if d >= head_dim)][0], (4,)
    # fp8 rows are in halves at small batches and whole at large ones: both must agree
    layouts = [None, True, False] if fmt == "fp8" else [None]
    cases = [*itertools.product((1, 4, 32), [None], layouts), *itertools.product(long_splits, [long_tiles], layouts)]
    for splits, tile, halves in cases:
        got1 = attention.paged_attention_cache(
            q1.to(DEVICE), device_cache, on_device(decode), scale, softcap=30.0, num_splits=splits,
            decode_tiles=tile, halves=halves,
        )  # fmt: skip
        assert relative_error(got1, want1) < TOL[dtype], (splits, tile, halves)


@pytest.mark.skipif(not ON_GPU, reason="the split count from a compiled kernel's registers: GPU only")
@pytest.mark.parametrize("fmt", ["fp8", "turbo3"])
def test_decode_of_one_sequence_fills_one_wave(fmt, monkeypatch):
    """At batch 1 over a long context the decode takes long tiles in one wave of as many
    splits as the compiled kernel lets the multiprocessors hold (a count that need not
    be a power of two), and reads the cache as the reference does."""
    asked = []
    programs_per_sm = attention._programs_per_sm
    monkeypatch.setattr(attention, "_programs_per_sm", lambda *a: asked.append(programs_per_sm(*a)) or asked[-1])
    dtype, head_dim = torch.float16, 128
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    context = math.ceil(sms / 2) * 2 * attention._LONG_DECODE_TILES[head_dim][0].block_n + 5  # (2 KV heads)
    _, device_cache, meta = write_case(fmt, dtype, head_dim, [context], [1], block_size=16)
    q = torch.randn(1, 4, head_dim).to(dtype)
    want = CPU.attend(q.float(), to_cpu(device_cache), meta, head_dim**-0.5)
    got = attention.paged_attention_cache(q.to(DEVICE), device_cache, on_device(meta), head_dim**-0.5)
    assert asked and asked[0] >= 1  # the one-wave rule chose the splits
    assert relative_error(got, want) < TOL[dtype]


@pytest.mark.parametrize("fmt", ["turbo4"])
def test_sliding_window_over_quantized_cache(fmt):
    dtype = torch.float32
    _, device_cache, meta = write_case(fmt, dtype, 64, [40, 23], [12, 1])
    q = torch.randn(13, 2, 64)
    want = CPU.attend(q, to_cpu(device_cache), meta, 0.125, window=16)
    got = CUDA.attend(q.to(DEVICE), device_cache, on_device(meta), 0.125, window=16)
    assert relative_error(got, want) < TOL[dtype]


def with_shadows(
    cache: LayerKVCache, meta: AttentionMetadata, window: int, drop: int
) -> tuple[LayerKVCache, AttentionMetadata]:
    """The cache with shadow blocks (a recent window of ``window``) and the metadata
    naming them: every block of each sequence has one but block ``drop`` (a shadow
    returned or never taken), in scattered order."""
    num_blocks, block_size, kv_heads, head_dim = cache["k"].shape[:3] + (cache.head_dim,)
    cache.shadows = tuple(
        torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=cache.dtype, device=cache["k"].device)
        for _ in "kv"
    )
    cache.recent_window = window
    order = torch.randperm(num_blocks).to(torch.int32)
    tables = order[meta.block_tables.long()]
    tables[:, drop] = -1
    return cache, replace(meta, shadows=ShadowPages(tables, torch.full_like(meta.slot_mapping, -1)))


@pytest.mark.parametrize("fmt, window", [("fp8", 11), ("turbo4", 11), ("turbo3", 11), ("turbo4", 37)])
def test_recent_window_reads_shadows_like_the_reference(fmt, window, monkeypatch):
    """Shadow writes equal the reference's; prefill and decode read each key exact where
    the CPU backend does (within the window of the query, or in the first block)."""
    dtype = torch.float32
    # With a window of 11 the decode query at 41 reads 31 on exact, the last key of a
    # 16-key tile; the one at 79 reads tiles between its first block and its window
    # that hold no exact key. A window of 37 spreads its keys over three exact tiles.
    reference, device_cache, meta = write_case(fmt, dtype, 64, [45, 42, 80, 9], [13, 1, 1, 9])
    block_size = reference.block_size
    reference, meta = with_shadows(reference, meta, window=window, drop=2)
    device_cache.shadows = tuple(torch.zeros_like(s, device=DEVICE) for s in reference.shadows)
    device_cache.recent_window = reference.recent_window
    # every context position written to its shadow slot (the reference of the slots)
    positions = [torch.arange(n) for n in meta.seq_lens.tolist()]
    k = torch.randn(sum(len(p) for p in positions), 2, 64)
    v = torch.randn_like(k)
    slots = torch.cat([
        torch.where(meta.shadows.tables[b, p // block_size] >= 0, meta.shadows.tables[b, p // block_size].long() * block_size + p % block_size, -1)
        for b, p in enumerate(positions)
    ])  # fmt: skip
    CPU.write_shadow_kv(k, v, reference, slots)
    CUDA.write_shadow_kv(k.to(DEVICE), v.to(DEVICE), device_cache, slots.to(DEVICE))
    for got, want in zip(device_cache.shadows, reference.shadows):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)

    q = torch.randn(int(meta.cu_seqlens_q[-1]), 4, 64)
    want = CPU.attend(q, reference, meta, 0.125)
    for splits in (1, 4):
        got = attention.paged_attention_cache(q.to(DEVICE), device_cache, on_device(meta), 0.125, num_splits=splits)
        assert relative_error(got, want) < TOL[dtype], splits
    if fmt == "fp8":  # the reduce launch merging the exact part with the splits that ran
        monkeypatch.setattr(attention, "MERGE_SPLITS", 0)
        got = attention.paged_attention_cache(q.to(DEVICE), device_cache, on_device(meta), 0.125, num_splits=16)
        assert relative_error(got, want) < TOL[dtype]
    plain = CPU.attend(q, reference, replace(meta, shadows=None), 0.125)
    assert relative_error(plain, want) > 10 * TOL[dtype]  # the window changed what was read


@pytest.mark.parametrize("fmt", ["fp8", "turbo3"])
def test_recent_window_decode_with_long_tiles(fmt):
    """Decode over 128-key tiles with a window: the splits start at the first whole tile
    and the exact part takes the rest of it (a context longer than a tile and two
    within one, the first reaching into its window)."""
    dtype = torch.float32
    reference, device_cache, meta = write_case(fmt, dtype, 64, [300, 130, 100], [1, 1, 1])
    reference, meta = with_shadows(reference, meta, window=11, drop=3)
    device_cache.shadows = tuple(s.to(DEVICE) for s in reference.shadows)
    device_cache.recent_window = reference.recent_window
    q = torch.randn(3, 4, 64)
    want = CPU.attend(q, reference, meta, 0.125)
    for splits in (1, 3):
        got = attention.paged_attention_cache(q.to(DEVICE), device_cache, on_device(meta), 0.125, num_splits=splits,
                                              decode_tiles=attention._LONG_DECODE_TILES[64][0])  # fmt: skip
        assert relative_error(got, want) < TOL[dtype], splits


def step_slots(cache: LayerKVCache, meta: AttentionMetadata, tables: torch.Tensor | None = None) -> torch.Tensor:
    """The slots of each sequence's last ``q_len`` positions, the step's own tokens, in
    the blocks of ``tables`` (the block tables unless given; -1 entries give -1)."""
    tables = meta.block_tables if tables is None else tables
    q_lens = meta.cu_seqlens_q.diff().tolist()
    slots = []
    for b, (n, q_len) in enumerate(zip(meta.seq_lens.tolist(), q_lens)):
        for p in range(n - q_len, n):
            block = int(tables[b, p // cache.block_size])
            slots.append(block * cache.block_size + p % cache.block_size if block >= 0 else -1)
    return torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize(
    "fmt, head_dim, dtype",
    [
        ("fp8", 64, torch.float32),
        ("turbo4", 128, torch.float16),
        ("turbo3", 64, torch.float16),
        ("auto", 64, torch.float16),
    ],
)
def test_attention_op_stores_the_step_then_attends(fmt, head_dim, dtype):
    """The op as a layer calls it: the step's K/V stored like the CPU backend stores
    them, then attended over with the earlier context. Where keys are rotated, the
    write launch brings the queries into the keys' basis and attention reads them
    ready: that must equal the reference's query rotation."""
    from xinfer_cuda.kernels.kv_quant_write import quant_write_kv

    reference, device_cache, meta = write_case(fmt, dtype, head_dim, [37, 20, 9], [5, 1, 9])
    meta = replace(meta, slot_mapping=step_slots(reference, meta))
    tokens, heads, scale = int(meta.cu_seqlens_q[-1]), 4, head_dim**-0.5
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    k, v = torch.randn(tokens, 2, head_dim).to(dtype), torch.randn(tokens, 2, head_dim).to(dtype)
    device_meta = replace(on_device(meta), slot_mapping=meta.slot_mapping.to(DEVICE))

    CPU.attention(q, k, v, reference, meta, scale)
    got = CUDA.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), device_cache, device_meta, scale)
    assert_same_storage(device_cache, reference)
    want = CPU.attend(q.float(), to_cpu(device_cache), meta, scale)  # over what the device stored
    assert relative_error(got, want) < TOL[dtype]

    kv_format = get_format(fmt)
    rotated = quant_write_kv(k.to(DEVICE), v.to(DEVICE), device_cache, device_meta.slot_mapping, q.to(DEVICE))
    if not kv_format.rotate_keys:
        assert rotated is None
        return
    want_q = kv_format.prepare_query(q.float(), reference.equalizer)
    assert relative_error(rotated.float(), want_q) < TOL[dtype]


@pytest.mark.parametrize("fmt, dtype", [("fp8", torch.float32), ("turbo3", torch.float16)])
def test_attention_op_stores_the_step_with_its_shadows(fmt, dtype):
    """With a recent window the op's one write launch also stores the step's exact
    copies where a token's block has a shadow (not where it has none): the codes, the
    shadows and the output equal the CPU backend's."""
    reference, device_cache, meta = write_case(fmt, dtype, 64, [37, 20, 9], [5, 1, 9])
    # block 1 has no shadow: the second sequence's decode token (position 19) stores none
    reference, meta = with_shadows(reference, meta, window=11, drop=1)
    device_cache.shadows = tuple(torch.zeros_like(s, device=DEVICE) for s in reference.shadows)
    device_cache.recent_window = reference.recent_window
    slots, shadow_slots = step_slots(reference, meta), step_slots(reference, meta, meta.shadows.tables)
    assert (shadow_slots < 0).sum() == 1
    meta = replace(meta, slot_mapping=slots, shadows=ShadowPages(meta.shadows.tables, shadow_slots))
    tokens, heads, scale = int(meta.cu_seqlens_q[-1]), 4, 0.125
    q = torch.randn(tokens, heads, 64).to(dtype)
    k, v = torch.randn(tokens, 2, 64).to(dtype), torch.randn(tokens, 2, 64).to(dtype)
    device_meta = on_device(meta)

    want = CPU.attention(q, k, v, reference, meta, scale)
    got = CUDA.attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), device_cache, device_meta, scale)
    assert_same_storage(device_cache, reference)
    for got_shadow, want_shadow in zip(device_cache.shadows, reference.shadows):
        assert want_shadow.abs().sum() > 0
        torch.testing.assert_close(got_shadow.cpu().float(), want_shadow.float(), rtol=1e-3, atol=1e-3)
    assert relative_error(got, want.float()) < TOL[dtype]
