"""Per-layer cache kinds: the pools of each page group, the planner's split of memory
between them, and a model whose layers cache one vector per token (as MLA's latent) and
a recurrent state per sequence (as Gated DeltaNet), run through the engine against the
same model computed without any cache."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig

from tests.tiny_models import COMMON, gemma3_config, prompt, save_tiny_model
from xinfer import LLM, SamplingParams, registry
from xinfer.cache.block_pool import NO_BLOCK, BlockPool
from xinfer.cache.manager import CacheManager
from xinfer.cache.specs import (
    AttentionSpec,
    RecurrentStateSpec,
    TokenVectorSpec,
    compressed_rows,
    compressed_slots,
    page_groups,
)
from xinfer.engine import memory_plan
from xinfer.engine.memory_plan import blocks_kept, split_budget
from xinfer.engine.sequence import Sequence
from xinfer.forward_context import attention_metadata, state_slots
from xinfer.model import CausalLM

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def seq_of(length: int, seed: int = 0) -> Sequence:
    return Sequence(f"s{seed}-{length}", prompt(length, seed=seed), SamplingParams())


# ---- pools --------------------------------------------------------------------------


def test_a_sliding_pool_gives_back_the_blocks_its_window_passed():
    full, sliding = BlockPool(32, block_size=4), BlockPool(32, block_size=4, window=6)
    manager = CacheManager([full, sliding])
    seq = seq_of(30)
    assert manager.allocate(seq, 30)
    seq.num_computed_tokens = 30  # the next query, at 30, reads keys 25..30: blocks 6 and 7
    manager.commit(seq)
    manager.trim(seq)
    assert NO_BLOCK not in seq.pages[0].blocks and len(seq.pages[0].blocks) == 8
    assert seq.pages[1].blocks[:6] == [NO_BLOCK] * 6 and NO_BLOCK not in seq.pages[1].blocks[6:]
    assert (full.num_free_blocks, sliding.num_free_blocks) == (32 - 8, 32 - 2)
    manager.release(seq)
    assert full.num_free_blocks == sliding.num_free_blocks == 32


def test_a_prefix_hit_needs_every_pool_to_serve_it():
    full, sliding = BlockPool(32, block_size=4), BlockPool(32, block_size=4, window=6)
    manager = CacheManager([full, sliding])
    first = seq_of(30)
    assert manager.allocate(first, 30)
    first.num_computed_tokens = 30
    manager.commit(first)
    manager.trim(first)
    manager.release(first)
    # the sliding pool kept (cached, free) all 8 blocks: the whole prompt but its last token is a hit
    again = seq_of(30)
    assert manager.match_prefix(again) == 28
    assert again.pages[1].blocks[:5] == [NO_BLOCK] * 5  # a query at 28 reads from 23: blocks 5 and 6
    assert NO_BLOCK not in again.pages[0].blocks
    manager.release(again)
    # the sliding pool's blocks 5 and 6 handed to others: the hit falls back to where both pools serve
    tokens = prompt(30)
    for index in (5, 6):
        block_id = sliding.cached_block(_hashes(tokens)[index], _chunks(tokens)[index])
        sliding._forget(sliding.blocks[block_id])
    third = seq_of(30)
    assert manager.match_prefix(third) == 20  # a query at 20 reads from 15: blocks 3 and 4, still cached
    manager.release(third)


def _chunks(tokens: list[int], block_size: int = 4) -> list[tuple[int, ...]]:
    return [tuple(tokens[i : i + block_size]) for i in range(0, len(tokens) - block_size, block_size)]


def _hashes(tokens: list[int], block_size: int = 4) -> list[int]:
    hashes, parent = [], None
    for chunk in _chunks(tokens, block_size):
        parent = hash((parent, chunk))
        hashes.append(parent)
    return hashes


def test_layers_group_by_the_positions_they_read():
    class Layer(nn.Module):
        def __init__(self, spec):
            super().__init__()
            self.spec, self.cache, self.page_group = spec, None, 0

        def cache_spec(self):
            return self.spec

    layers = [Layer(AttentionSpec(1, 8, 512)), Layer(AttentionSpec(2, 16)), Layer(TokenVectorSpec(576)),
              Layer(RecurrentStateSpec({"s": (4, 4)})), Layer(AttentionSpec(1, 8, 1024)), Layer(AttentionSpec(1, 8, 512))]  # fmt: skip
    groups = page_groups(layers)
    assert [g.window for g in groups] == [None, 1024, 512]
    assert [len(g.layers) for g in groups] == [2, 1, 2]
    assert groups[0].bytes_per_token(_auto(), torch.bfloat16) == 2 * 2 * 16 * 2 + 576 * 2


@pytest.mark.parametrize(("ratio", "rows"), [(4, 4), (16, 1), (32, 1)])
def test_a_vector_per_ratio_tokens_lives_in_the_block_of_its_last_position(ratio, rows):
    """Vector ``w`` of a ``ratio`` cache is written by the token at ``(w + 1) * ratio - 1`` into that
    token's block and read back from there, through a scrambled page table; a block holds
    ``block_size / ratio`` of them, or one where a window spans blocks."""
    spec, block_size, num_tokens = TokenVectorSpec(8, ratio=ratio), 16, 96
    assert spec.rows_per_block(block_size) == rows
    assert spec.block_bytes(_auto(), torch.float32, block_size) == rows * 8 * 4
    cache = spec.allocate(10, block_size, _auto(), torch.float32, torch.device("cpu"))
    table = torch.tensor([7, 2, 9, 0, 5, 3], dtype=torch.int32)
    positions = torch.arange(num_tokens)
    slot_mapping = table[positions // block_size].long() * block_size + positions % block_size
    slots = compressed_slots(slot_mapping, positions, ratio, block_size)
    assert ((slots >= 0) == ((positions + 1) % ratio == 0)).all()
    values = torch.randn(num_tokens, 8)
    cache.view(-1, 8)[slots[slots >= 0]] = values[slots >= 0]
    count = num_tokens // ratio
    rows_read = compressed_rows(table, count, ratio, block_size)
    assert torch.equal(cache.view(-1, 8)[rows_read], values[(torch.arange(count) + 1) * ratio - 1])
    assert torch.equal(rows_read // rows, table[((torch.arange(count) + 1) * ratio - 1) // block_size].long())


def test_a_ratio_that_neither_divides_nor_is_a_multiple_of_the_block_size_is_refused():
    with pytest.raises(ValueError, match="a vector per 24 tokens needs a block size"):
        TokenVectorSpec(8, ratio=24).rows_per_block(16)


def _auto():
    from xinfer.kv import get_format

    return get_format("auto")


# ---- the planner ---------------------------------------------------------------------


def test_the_budget_holds_as_many_typical_sequences_in_every_pool():
    block_bytes, windows = [300, 1500], [None, 512]  # 3 full layers, 15 sliding ones (Gemma 3's 1:5)
    blocks = split_budget(10_000_000, block_bytes, windows, 16, typical_len=1024, step_tokens=512)
    kept = [blocks_kept(1024, w, 16) for w in windows]
    assert kept == [64, 33]
    assert sum(n * b for n, b in zip(blocks, block_bytes)) <= 10_000_000
    typical = [blocks[0] // kept[0], (blocks[1] - 32) // kept[1]]  # the step's 512 prompt tokens beside
    assert abs(typical[0] - typical[1]) <= 1
    one_pool = 10_000_000 // (300 + 1500)  # every layer keeping every position, as before
    assert blocks[0] > 1.6 * one_pool


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    save_tiny_model(gemma3_config(sliding_window=16, max_position_embeddings=2048), folder)
    return str(folder)


def test_sliding_layers_hold_only_their_window_and_give_the_same_tokens(gemma_dir, monkeypatch):
    """Gemma 3 (3 of 4 layers sliding): with per-window pools the same memory holds
    more tokens, and chunked, preempted and prefix-cached runs give the same tokens."""
    monkeypatch.setattr(memory_plan, "host_kv_budget", lambda fraction: 4 << 20)
    llm = LLM(model=gemma_dir, dtype="float32", max_model_len=2048, max_num_batched_tokens=64)
    pools = llm.engine.cache.pools
    assert [p.window for p in pools] == [None, 16]
    block = 4 * 64 * 2 * 2 * 16  # bytes of one block of one layer: 2 KV heads x 32 dims x K, V x fp32
    assert pools[0].num_blocks * 16 > 2 * (4 << 20) // (4 * block)  # more than twice one pool for all 4 layers
    prompts = [prompt(20 + 37 * i, seed=i) for i in range(5)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    whole = LLM(model=gemma_dir, dtype="float32", max_model_len=2048, num_blocks=256)  # prompts in one step
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY)] == expected
    small = LLM(model=gemma_dir, dtype="float32", max_model_len=200, num_blocks=24, max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, GREEDY)] == expected
    assert small.engine.stats().num_preemptions > 0
    hits = whole.generate(prompts, GREEDY)  # again: prefix-cache hits, the sliding pool serving only its window
    assert [o.outputs[0].token_ids for o in hits] == expected
    assert all(o.num_cached_tokens == (len(o.prompt_token_ids) - 1) // 16 * 16 for o in hits)
    for engine in (llm.engine, whole.engine, small.engine):
        assert all(p.num_free_blocks == p.num_blocks for p in engine.cache.pools)


# ---- latent vectors and recurrent states through the engine ----------------------------


class TokenMemory(nn.Module):
    """Caches one vector per token; each token reads the mean of its sequence's vectors so far."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.cache, self.page_group = width, None, 0

    def cache_spec(self) -> TokenVectorSpec:
        return TokenVectorSpec(self.width)

    def forward(self, x: Tensor) -> Tensor:
        meta = attention_metadata(self.page_group)
        flat = self.cache.view(-1, self.width)
        valid = meta.slot_mapping >= 0
        flat[meta.slot_mapping[valid]] = x[valid]
        out = torch.empty_like(x)
        block_size = self.cache.shape[1]
        for b, (start, end) in enumerate(zip(meta.cu_seqlens_q.tolist(), meta.cu_seqlens_q[1:].tolist())):
            context = meta.seq_lens[b].item()
            blocks = meta.block_tables[b, : -(-context // block_size)].long()
            vectors = self.cache[blocks].flatten(0, 1)[:context]
            means = vectors.cumsum(0) / torch.arange(1, context + 1, device=x.device).unsqueeze(1)
            out[start:end] = means[context - (end - start) :]
        return out


class RunningSum(nn.Module):
    """A recurrent state per sequence: the sum of its inputs so far."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.cache, self.page_group = width, None, 0

    def cache_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec({"sum": (self.width,)}, torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        meta, slots, state = attention_metadata(), state_slots(), self.cache["sum"]
        out = torch.empty_like(x)
        for b, (start, end) in enumerate(zip(meta.cu_seqlens_q.tolist(), meta.cu_seqlens_q[1:].tolist())):
            first = meta.seq_lens[b].item() == end - start  # the sequence's first step: a fresh state
            before = torch.zeros(self.width, device=x.device) if first else state[slots[b]]
            sums = before + x[start:end].cumsum(0)
            out[start:end] = sums
            state[slots[b]] = sums[-1]
        return out


class CachingToyForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__(config)
        dim = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, dim)
        self.memory, self.running = TokenMemory(dim), RunningSum(dim)
        self.head = nn.Linear(dim, config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.embed(input_ids)
        return torch.tanh(x + self.memory(x) + 0.1 * self.running(x))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden)

    def reference_logits(self, token_ids: list[int]) -> Tensor:
        """The same computation over the whole sequence, with no cache."""
        x = self.embed(torch.tensor(token_ids))
        means = x.cumsum(0) / torch.arange(1, len(token_ids) + 1).unsqueeze(1)
        return self.head(torch.tanh(x + means + 0.1 * x.cumsum(0)))


@pytest.fixture()
def toy_model_dir(tmp_path, monkeypatch):
    config = LlamaConfig(**COMMON, architectures=["CachingToyForCausalLM"])
    config.save_pretrained(tmp_path)
    known = registry.model_class
    monkeypatch.setattr(
        registry,
        "model_class",
        lambda name, pm=None: CachingToyForCausalLM if name.startswith("CachingToy") else known(name, pm),
    )
    return str(tmp_path)


def reference_tokens(model: CachingToyForCausalLM, prompt_ids: list[int], count: int) -> list[int]:
    tokens = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(count):
            tokens.append(int(model.reference_logits(tokens)[-1].argmax()))
    return tokens[len(prompt_ids) :]


def test_vectors_per_token_and_states_per_sequence_through_the_engine(toy_model_dir, monkeypatch):
    prompts = [prompt(5 + 23 * i, seed=i) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    options = dict(model=toy_model_dir, dtype="float32", load_format="dummy", block_size=4)
    llm = LLM(**options, num_blocks=128, max_num_batched_tokens=16, max_num_seqs=4)  # chunked prompts
    assert [p.window for p in llm.engine.cache.pools] == [None] and llm.engine.cache.states.num_slots == 4
    expected = [reference_tokens(llm.engine.model, p, params.max_tokens) for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    small = LLM(**options, num_blocks=40, max_num_seqs=3, max_model_len=160)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == expected
    assert small.engine.stats().num_preemptions > 0
    for engine in (llm.engine, small.engine):
        assert engine.cache.states.num_free == engine.cache.states.num_slots
        assert all(p.num_free_blocks == p.num_blocks for p in engine.cache.pools)


def test_recurrent_states_get_their_memory_share(toy_model_dir, monkeypatch):
    monkeypatch.setattr(memory_plan, "host_kv_budget", lambda fraction: 1 << 20)
    options = dict(model=toy_model_dir, dtype="float32", load_format="dummy", max_model_len=256)
    default = LLM(**options).engine
    slot_bytes = COMMON["hidden_size"] * 4
    assert default.cache.states.num_slots == default.config.scheduler.max_num_seqs
    shared = LLM(**options, mamba_fraction=0.25, state_snapshot_interval=100).engine
    assert shared.cache.states.num_slots == (1 << 20) // 4 // slot_bytes
    assert (default.cache.snapshot_interval, shared.cache.snapshot_interval) == (1024, 96)  # whole blocks of 16
    assert shared.config.scheduler.max_num_seqs <= shared.cache.states.num_slots
    assert shared.cache.pools[0].num_blocks < default.cache.pools[0].num_blocks
    for engine in (default, shared):  # the prefix cache's state snapshots: a quarter as many slots, beside
        assert engine.cache.states.num_snapshots == -(-engine.cache.states.num_slots // 4)
    uncached = LLM(**options, mamba_fraction=0.25, enable_prefix_caching=False).engine
    assert uncached.cache.states.num_slots == shared.cache.states.num_slots and not uncached.cache.states.num_snapshots
    assert uncached.cache.pools[0].num_blocks > shared.cache.pools[0].num_blocks
    # a share too small for one state says how much one takes and how much the share is ("0.00 GiB" said nothing)
    with pytest.raises(ValueError, match=r"recurrent state \(0.02 MiB\) in its share of the cache \(0.01 MiB\)"):
        LLM(**{**options, "hf_overrides": {"hidden_size": 5120}}, mamba_fraction=0.01)
