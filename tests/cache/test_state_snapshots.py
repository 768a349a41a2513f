"""Prefix caching for models with recurrent state: the state pool's snapshots and their
eviction, and a toy hybrid model (causal attention over its paged cache beside a decayed
running sum kept as a recurrent state, positions added to the embeddings) run through the
engine with prefix hits against the same model computed over the whole sequence without
any cache."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt
from xinfer import LLM, SamplingParams, registry
from xinfer.cache.specs import RecurrentStateSpec, TokenVectorSpec
from xinfer.cache.state_pool import StatePool, copy_slots
from xinfer.forward_context import attention_metadata, state_slots
from xinfer.model import CausalLM

BLOCK, INTERVAL = 4, 8
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

# ---- the pool --------------------------------------------------------------------------


def test_snapshots_copy_slots_and_are_evicted_least_recently_used():
    state = torch.zeros(4, 3)
    pool = StatePool(
        num_slots=2, num_snapshots=2, copy=lambda source, target: copy_slots([{"s": state}], [(source, target)])
    )
    seq = pool.acquire()
    state[seq] = 1.0
    pool.take(seq, prefix_hash=11)
    state[seq] = 2.0
    pool.take(seq, prefix_hash=22)
    state[seq] = 3.0
    pool.take(seq, prefix_hash=11)  # there already: kept as it was
    assert state[pool.snapshots[11]].tolist() == [1.0] * 3 and state[pool.snapshots[22]].tolist() == [2.0] * 3
    restored = pool.restore(pool.snapshot(11))  # 11 now the most recently used
    assert state[restored].tolist() == [1.0] * 3 and restored not in pool.snapshots.values()
    assert pool.num_free == 0
    pool.release(restored)
    pool.take(seq, prefix_hash=33)  # reuses the slot given back before any snapshot
    assert set(pool.snapshots) == {11, 22, 33}
    state[seq] = 4.0
    pool.take(seq, prefix_hash=44)  # evicts the least recently used: 22
    assert set(pool.snapshots) == {11, 33, 44} and state[pool.snapshots[44]].tolist() == [4.0] * 3
    pool.release(seq)
    other = pool.acquire()  # a sequence takes the slot given back, leaving every snapshot
    assert other == seq and set(pool.snapshots) == {11, 33, 44}


# ---- a toy hybrid model ---------------------------------------------------------------


def causal_attention(queries: Tensor, keys: Tensor) -> Tensor:
    """Each of the last len(queries) positions attends to the keys (= values) up to it."""
    first = len(keys) - len(queries)
    scores = queries @ keys.T / math.sqrt(keys.shape[1])
    position = torch.arange(len(queries)).unsqueeze(1) + first
    scores = scores.masked_fill(torch.arange(len(keys)).unsqueeze(0) > position, float("-inf"))
    return scores.softmax(-1) @ keys


def decayed_sums(x: Tensor, initial: Tensor, decay: float) -> Tensor:
    """s_t = decay * s_(t-1) + x_t from s_(-1) = ``initial``, every s_t."""
    sums, state = [], initial
    for row in x:
        state = decay * state + row
        sums.append(state)
    return torch.stack(sums)


class PagedAttention(nn.Module):
    """Causal attention whose keys and values are its inputs, cached one vector per token."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.cache, self.page_group = width, None, 0

    def cache_spec(self) -> TokenVectorSpec:
        return TokenVectorSpec(self.width)

    def forward(self, x: Tensor) -> Tensor:
        meta = attention_metadata(self.page_group)
        valid = meta.slot_mapping >= 0
        self.cache.view(-1, self.width)[meta.slot_mapping[valid]] = x[valid]
        out = torch.empty_like(x)
        for b, (start, end) in enumerate(zip(meta.cu_seqlens_q.tolist(), meta.cu_seqlens_q[1:].tolist())):
            context = meta.seq_lens[b].item()
            blocks = meta.block_tables[b, : -(-context // BLOCK)].long()
            out[start:end] = causal_attention(x[start:end], self.cache[blocks].flatten(0, 1)[:context])
        return out


class DecayedSum(nn.Module):
    """A recurrent state per sequence: the decayed running sum of its inputs."""

    decay = 0.9

    def __init__(self, width: int):
        super().__init__()
        self.width, self.cache, self.page_group = width, None, 0

    def cache_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec({"sum": (self.width,)}, torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        meta, slots, state = attention_metadata(), state_slots(), self.cache["sum"]
        out = torch.empty_like(x)
        for b, (start, end) in enumerate(zip(meta.cu_seqlens_q.tolist(), meta.cu_seqlens_q[1:].tolist())):
            starts = meta.seq_lens[b].item() == end - start  # the sequence starts in this step: a zero state
            initial = torch.zeros(self.width) if starts else state[slots[b]]
            out[start:end] = decayed_sums(x[start:end], initial, self.decay)
            state[slots[b]] = out[end - 1]
        return out


class HybridToyForCausalLM(CausalLM):
    def __init__(self, config):
        super().__init__(config)
        dim = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, dim)
        self.attention, self.recurrent = PagedAttention(dim), DecayedSum(dim)
        self.head = nn.Linear(dim, config.vocab_size, bias=False)
        self.register_buffer("frequencies", torch.rand(dim, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        x = self.embed(input_ids) + torch.sin(positions.unsqueeze(1) * self.frequencies)
        x = x + self.attention(x)
        return torch.tanh(x + 0.3 * self.recurrent(x))

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.head(hidden)

    def reference_logits(self, token_ids: list[int]) -> Tensor:
        """The same computation over the whole sequence, with no cache."""
        positions = torch.arange(len(token_ids))
        x = self.embed(torch.tensor(token_ids)) + torch.sin(positions.unsqueeze(1) * self.frequencies)
        x = x + causal_attention(x, x)
        return self.head(torch.tanh(x + 0.3 * decayed_sums(x, torch.zeros(x.shape[1]), DecayedSum.decay)))


@pytest.fixture()
def hybrid_dir(tmp_path, monkeypatch):
    config = LlamaConfig(**COMMON, architectures=["HybridToyForCausalLM"])
    config.save_pretrained(tmp_path)
    known = registry.model_class
    monkeypatch.setattr(
        registry,
        "model_class",
        lambda name, pm=None: HybridToyForCausalLM if name == "HybridToyForCausalLM" else known(name, pm),
    )
    return str(tmp_path)


def hybrid_llm(model_dir: str, **options) -> LLM:
    defaults = dict(num_blocks=96, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64)
    options = defaults | dict(state_snapshot_interval=INTERVAL, load_format="dummy", block_size=BLOCK) | options
    return LLM(model=model_dir, dtype="float32", **options)


def reference_tokens(llm: LLM, prompt_ids: list[int], count: int = GREEDY.max_tokens) -> list[int]:
    tokens = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(count):
            tokens.append(int(llm.engine.model.reference_logits(tokens)[-1].argmax()))
    return tokens[len(prompt_ids) :]


def run_one_by_one(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """Each prompt's tokens and cached prompt tokens, one request after the other."""
    return [(o.outputs[0].token_ids, o.num_cached_tokens) for p in prompts for o in llm.generate([p], GREEDY)]


BASE = prompt(40, seed=1)


def sharing(length: int, seed: int, total: int = 34) -> list[int]:
    """The first ``length`` tokens of BASE, then tokens of its own."""
    return BASE[:length] + prompt(total - length, seed=seed)


# Snapshot points of BASE (40 tokens): every INTERVAL tokens (8, 16, 24, 32) and its last block boundary (36).
PREFIXES = [  # (prompt, prompt tokens it finds cached)
    (BASE, 0),
    (sharing(0, seed=2), 0),  # nothing shared
    (sharing(4, seed=3), 0),  # one block: no snapshot there (the pools serve it: its end gets one)
    (sharing(4, seed=4), 4),  # ... the snapshot the one before took
    (sharing(16, seed=5), 16),  # exactly a snapshot point
    (sharing(22, seed=6), 16),  # mid-block: the snapshot point below; the blocks to 20 served, so one taken there
    (sharing(22, seed=7), 20),
    (sharing(27, seed=8), 24),
    (BASE, 36),  # the whole prompt but its last block (a token is left to compute)
]


def test_prefix_hits_give_the_tokens_of_the_whole_computation(hybrid_dir):
    llm = hybrid_llm(hybrid_dir, max_num_seqs=32)  # slots for every prompt's snapshots: none evicted
    prompts = [p for p, _ in PREFIXES]
    expected = [reference_tokens(llm, p) for p in prompts]
    assert run_one_by_one(llm, prompts) == [(tokens, cached) for tokens, (_, cached) in zip(expected, PREFIXES)]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == sum(cached for _, cached in PREFIXES) // BLOCK
    assert stats.prefix_cache_queries == sum((len(p) - 1) // BLOCK for p in prompts)
    # chunked over several steps (8 tokens a step, and ending at snapshot points), and all at once
    chunked = hybrid_llm(hybrid_dir, max_num_batched_tokens=8)
    assert [tokens for tokens, _ in run_one_by_one(chunked, prompts)] == expected
    together = hybrid_llm(hybrid_dir).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in together] == expected
    for engine in (llm.engine, chunked.engine):
        assert engine.cache.states.num_free == engine.cache.states.num_slots
        assert all(p.num_free_blocks == p.num_blocks for p in engine.cache.pools)


def test_a_hit_without_its_snapshot_state_gives_other_tokens(hybrid_dir, monkeypatch):
    """The toy's tokens depend on the restored state: the comparisons above can fail."""
    llm = hybrid_llm(hybrid_dir)
    monkeypatch.setattr(StatePool, "restore", lambda pool, snapshot: pool.acquire())  # the slot's stale state
    (_, cached), (tokens, again) = run_one_by_one(llm, [BASE, BASE])
    assert (cached, again) == (0, 36)
    assert tokens != reference_tokens(llm, BASE)


def test_without_prefix_caching_no_snapshots_and_no_chunk_ends(hybrid_dir):
    llm = hybrid_llm(hybrid_dir, enable_prefix_caching=False)
    assert llm.engine.cache.states.num_snapshots == 0
    assert llm.engine.cache.next_snapshot(llm.engine.add_request("r", BASE, GREEDY)) == len(BASE)
    assert run_one_by_one(llm, [BASE]) == [(reference_tokens(llm, BASE), 0)]
    assert llm.engine.stats().prefix_cache_hits == 0


def test_snapshots_are_evicted_when_their_slots_run_out(hybrid_dir):
    """One sequence at a time: a slot for it and one for a snapshot, each new snapshot
    evicting the one before. Evicted snapshots are recomputed, never served stale."""
    llm = hybrid_llm(hybrid_dir, max_num_seqs=1)
    states = llm.engine.cache.states
    assert (states.num_slots, states.num_snapshots) == (1, 1)
    other = prompt(40, seed=9)
    prompts = [BASE, BASE, other, other, BASE]
    expected = [reference_tokens(llm, p) for p in prompts]
    results = run_one_by_one(llm, prompts)
    assert [tokens for tokens, _ in results] == expected
    # BASE leaves its last snapshot (at 36); `other`'s replace it
    assert [cached for _, cached in results] == [0, 36, 0, 36, 0]
    assert len(states.snapshots) == 1


def test_preempted_sequences_recompute_from_their_own_snapshots(hybrid_dir):
    prompts = [prompt(30 + 9 * i, seed=20 + i) for i in range(5)]
    llm = hybrid_llm(hybrid_dir, num_blocks=24, max_model_len=96, max_num_batched_tokens=16)
    expected = [reference_tokens(llm, p, 20) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0  # no prompt shares a block with another: the hits are their own
    assert llm.engine.cache.states.num_free == llm.engine.cache.states.num_slots
    assert all(p.num_free_blocks == p.num_blocks for p in llm.engine.cache.pools)
