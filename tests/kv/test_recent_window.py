"""The recent window: keys within W of a query, and each sequence's first block, read
exact from shadow blocks beside a quantized cache (docs/kv-cache.md)."""

from dataclasses import replace

import pytest
import torch

from tests.tiny_models import prompt
from xinfer import LLM, SamplingParams
from xinfer.cache.block_pool import BlockPool
from xinfer.cache.manager import CacheManager
from xinfer.cache.recent_window import RecentWindow
from xinfer.engine.sequence import Sequence
from xinfer.kv import get_format
from xinfer.ops import AttentionMetadata, ShadowPages
from xinfer.torch_ops import TorchOps, attend

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [prompt(3 + 29 * i, seed=i) for i in range(6)]  # 3 .. 148 tokens


def test_attention_reads_exact_keys_within_the_window_and_the_first_block():
    torch.manual_seed(0)
    fmt, block_size, window, heads, kv_heads, dim = get_format("turbo4"), 4, 6, 4, 2, 32
    context, num_q = 23, 9  # a chunk of 9 queries at the end of 23 positions
    k, v = torch.randn(context, kv_heads, dim), torch.randn(context, kv_heads, dim)
    cache = fmt.allocate(8, block_size, kv_heads, dim, torch.float32, torch.device("cpu"))
    cache.shadows = tuple(torch.zeros(4, block_size, kv_heads, dim) for _ in "kv")
    cache.recent_window = window
    blocks = torch.tensor([5, 2, 7, 0, 1, 3], dtype=torch.int32)
    shadows = torch.tensor([3, -1, -1, 0, 2, 1], dtype=torch.int32)  # block 0, and the last three
    slots = (blocks.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:context]
    shadow_slots = (shadows.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:context]
    shadow_slots[shadows.repeat_interleave(block_size)[:context] < 0] = -1
    ops = TorchOps()
    earlier = context - num_q  # stored before; the op stores the chunk's own K/V
    ops.write_kv(k[:earlier], v[:earlier], cache, slots[:earlier])
    ops.write_shadow_kv(k[:earlier], v[:earlier], cache, shadow_slots[:earlier])
    meta = AttentionMetadata(
        torch.tensor([0, num_q], dtype=torch.int32), torch.tensor([context], dtype=torch.int32), blocks[None],
        slots[-num_q:], num_q, context, ShadowPages(shadows[None], shadow_slots[-num_q:]),
    )  # fmt: skip
    q = torch.randn(num_q, heads, dim)
    got = ops.attention(q, k[earlier:], v[earlier:], cache, meta, dim**-0.5)

    # the reference: each query attends over a context it picks key by key
    exact_k, exact_v = fmt.stored_basis(k, v)
    stored = {name: t.view(-1, *t.shape[2:])[slots] for name, t in cache.tensors.items()}
    quant_k, quant_v = fmt.decode(stored)
    has_shadow = shadows.repeat_interleave(block_size)[:context] >= 0
    rotated_q = fmt.prepare_query(q)
    want = []
    for i in range(num_q):
        q_pos = context - num_q + i
        pick = has_shadow & ((q_pos - torch.arange(context) < window) | (torch.arange(context) < block_size))
        keys = torch.where(pick[:, None, None], exact_k, quant_k)[: q_pos + 1]
        values = torch.where(pick[:, None, None], exact_v, quant_v)[: q_pos + 1]
        want.append(attend(rotated_q[i : i + 1], keys, values, dim**-0.5))
    want = fmt.finish_output(torch.cat(want))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = ops.attend(q, cache, replace(meta, shadows=None), dim**-0.5)
    assert not torch.allclose(plain, want, atol=1e-3)  # the window changed what was read


def test_a_window_over_the_whole_context_gives_the_unquantized_tokens(model_dir):
    auto = LLM(model=model_dir, dtype="float32", num_blocks=256)
    windowed = LLM(model=model_dir, dtype="float32", num_blocks=256, kv_cache_dtype="turbo3", kv_recent_window=512)
    quantized = LLM(model=model_dir, dtype="float32", num_blocks=256, kv_cache_dtype="turbo3")
    expected = [o.outputs[0].token_ids for o in auto.generate(PROMPTS, GREEDY)]
    assert [o.outputs[0].token_ids for o in windowed.generate(PROMPTS, GREEDY)] == expected
    assert [o.outputs[0].token_ids for o in quantized.generate(PROMPTS, GREEDY)] != expected


def test_chunks_and_preemption_give_the_same_tokens(model_dir):
    # fp8: the turbo formats' coarse codes flip on the last-bit differences GEMMs of
    # other shapes make, with or without the window (the op test above covers them)
    options = dict(dtype="float32", kv_cache_dtype="fp8", kv_recent_window=8, block_size=4,
                   enable_prefix_caching=False)  # fmt: skip
    whole = LLM(model=model_dir, num_blocks=512, max_num_batched_tokens=512, **options)
    expected = [o.outputs[0].token_ids for o in whole.generate(PROMPTS, GREEDY)]
    chunked = LLM(model=model_dir, num_blocks=512, max_num_batched_tokens=20, **options)
    assert [o.outputs[0].token_ids for o in chunked.generate(PROMPTS, GREEDY)] == expected
    small = LLM(model=model_dir, num_blocks=48, max_model_len=180, **options)
    assert [o.outputs[0].token_ids for o in small.generate(PROMPTS, GREEDY)] == expected
    assert small.engine.stats().num_preemptions > 0
    for llm in (whole, chunked, small):
        for pool in llm.engine.cache.pools:
            assert pool.num_free_blocks == pool.num_blocks and not pool.recent_window.shadow_of


def test_bad_settings_are_one_clear_error(model_dir):
    with pytest.raises(ValueError, match="choose one with kv_cache_dtype"):
        LLM(model=model_dir, dtype="float32", num_blocks=64, kv_recent_window=64)


def seq_of(length: int, seed: int = 0) -> Sequence:
    return Sequence(f"s{seed}", prompt(length, seed=seed), SamplingParams())


def windowed_manager(num_shadows: int, recent_window: int) -> tuple[CacheManager, RecentWindow]:
    window = RecentWindow(num_shadows, recent_window, block_size=4)
    return CacheManager([BlockPool(num_blocks=32, block_size=4, recent_window=window)]), window


def test_shadows_follow_the_window_and_block_zero_stays():
    manager, window = windowed_manager(num_shadows=12, recent_window=6)
    seq = seq_of(30)
    assert manager.allocate(seq, 30)
    table = seq.pages[0]
    assert all(s >= 0 for s in table.shadows) and len(table.shadows) == 8
    seq.num_computed_tokens = 30  # the next query at 30 reads exact keys 25..29 and block 0
    manager.commit(seq)
    manager.trim(seq)
    kept = [i for i, s in enumerate(table.shadows) if s >= 0]
    assert kept == [0, 6, 7]  # blocks 6 (24..27) and 7 (28..29); 24 < 25 but shares block 6
    assert len(window.free) == 12 - 3
    manager.release(seq)
    assert len(window.free) == 12 - 1  # block 0 keeps its shadow while it is cached

    again = seq_of(30)
    assert manager.match_prefix(again) == 28
    assert again.pages[0].shadows == [window.shadow_of[again.pages[0].blocks[0]]] + [-1] * 6  # only block 0 exact
    manager.release(again)


def test_a_first_block_whose_shadow_was_reclaimed_is_no_longer_a_hit():
    manager, _ = windowed_manager(num_shadows=4, recent_window=4)
    first = seq_of(12, seed=1)
    assert manager.allocate(first, 12)
    first.num_computed_tokens = 12
    manager.commit(first)
    manager.release(first)  # block 0 cached with its shadow: 3 shadows free
    other = seq_of(16, seed=2)
    assert manager.allocate(other, 16)  # needs 4: takes the cached block 0's shadow
    again = seq_of(12, seed=1)
    assert manager.match_prefix(again) == 0
