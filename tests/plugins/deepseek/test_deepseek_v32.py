"""DeepseekV32ForCausalLM against transformers' modeling code (fp32, CPU): V3's latent attention restricted
to the positions its lightning indexer selects. The tiny config selects 8 positions, so that prompts of 40
tokens (longer than the prefill chunk) attend sparsely, in prefill and decode; a prompt hitting the prefix
cache mid-way and preempted sequences reuse and recompute the indexer's cached keys. The ops' references:
sparse latent attention against dense attention under the selection's mask, the indexer's selection
against its scores computed densely."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV32Config
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer

from tests.plugins.deepseek.configs import latent_settings
from tests.plugins.deepseek.test_mla_op import BATCHES, DEVICE, KERNEL_DTYPES, KERNEL_TOL, assert_stored, paged_step
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_preempted_sequences_match_hf,
    assert_prefill_logits_match,
    assert_prefix_hit_mid_prompt_matches_hf,
    hf_greedy,
    randomize,
    spread_routing,
)
from tests.tiny_models import prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams, ops
from xinfer.quant import QuantizedTensor
from xinfer_deepseek import indexer_ops
from xinfer_deepseek.kernels import indexer, sparse_mla
from xinfer_deepseek.sparse_mla_ops import sparse_mla_attention

CHUNK = 32  # prefill chunk: the 40-token prompts take two steps
TOPK = 8
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def deepseek_v32_config(**overrides) -> DeepseekV32Config:
    """Latent attention's tiny shape, and an indexer of 8 heads of 16 dims selecting 8 positions."""
    settings = latent_settings() | dict(
        index_topk=TOPK, index_n_heads=8, index_head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"]
    )
    return DeepseekV32Config(**{**settings, "architectures": ["DeepseekV32ForCausalLM"], **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v32")
    hf = save_tiny_model(deepseek_v32_config(), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


@pytest.fixture(scope="module")
def models(checkpoint):
    hf, folder = checkpoint
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK)


@pytest.mark.parametrize("length", (3, 40))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    assert_greedy_tokens_and_logprobs_match(*models, 40)


def test_the_config_attends_sparsely(checkpoint):
    """transformers' own tokens change when its indexer selects every position: the tests above exercise
    the selection (a dense fallback would fail them)."""
    hf, _ = checkpoint
    tokens = prompt(40, seed=1)
    sparse, _ = hf_greedy(hf, tokens, NEW_TOKENS)
    indexers = [m for m in hf.modules() if isinstance(m, DeepseekV32Indexer)]
    try:
        for indexer in indexers:
            indexer.index_topk = 1024
        dense, _ = hf_greedy(hf, tokens, NEW_TOKENS)
    finally:
        for indexer in indexers:
            indexer.index_topk = TOPK
    assert dense != sparse


def test_a_wrong_selection_changes_the_tokens(checkpoint, monkeypatch):
    """Each query's latest positions instead of the indexer's best: not transformers' tokens."""
    hf, folder = checkpoint
    tokens = prompt(40, seed=1)

    def latest(q, key, weights, cache, meta, scale, topk):
        return latest_positions(meta, topk, q.shape[0])

    monkeypatch.setattr(indexer_ops, "indexer_topk", latest)
    monkeypatch.setattr(ops, "_plugin_functions", weakref.WeakKeyDictionary())  # ops resolved anew
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK)
    out = llm.generate([tokens], GREEDY)[0].outputs[0]
    assert out.token_ids != hf_greedy(hf, tokens, NEW_TOKENS)[0]


def latest_positions(meta, topk: int, num_tokens: int) -> torch.Tensor:
    selected = torch.full((num_tokens, topk), -1, dtype=torch.int32)
    cu = meta.cu_seqlens_q.tolist()
    for b, context_len in enumerate(meta.seq_lens.tolist()):
        for i, t in enumerate(range(cu[b], cu[b + 1])):
            position = context_len - (cu[b + 1] - cu[b]) + i
            window = torch.arange(max(position + 1 - topk, 0), position + 1)
            selected[t, : len(window)] = window.int()
    return selected


def test_a_prefix_cache_hit_mid_prompt_matches_hf(models):
    assert_prefix_hit_mid_prompt_matches_hf(*models, GREEDY)


def test_preempted_sequences_match_hf(checkpoint):
    hf, folder = checkpoint
    llm = LLM(model=str(folder), dtype="float32", num_blocks=7, max_model_len=96, max_num_batched_tokens=CHUNK)
    assert_preempted_sequences_match_hf(hf, llm, GREEDY)


# the logits' relative distance from the float model's each format keeps within (fp8's blocks of 128 values fit
# none of these rows)
ISQ_ERRORS = {"q8_0": 0.1, "q4_0": 0.5}


@pytest.mark.parametrize("isq", sorted(ISQ_ERRORS))
def test_quantized_at_load_the_indexers_head_weights_stay_float(checkpoint, isq):
    """--isq packed the indexer's weights_proj too, which the indexer reads as a float matrix: the first step failed
    (mat1 and mat2 shapes cannot be multiplied). It stays float now, as routers and gates do, and the packed
    model's logits stay near the float model's."""
    hf, folder = checkpoint
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK, isq=isq)
    indexers = [m for m in llm.engine.model.modules() if type(m).__name__ == "Indexer"]
    assert indexers and not any(isinstance(m.weights_proj.weight, QuantizedTensor) for m in indexers)
    assert isinstance(indexers[0].wk.weight, QuantizedTensor)  # what is a whole number of blocks is packed
    tokens = prompt(40)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    assert (got - expected).norm() / expected.norm() < ISQ_ERRORS[isq]
    assert llm.generate([tokens], GREEDY)[0].outputs[0].token_ids


def test_the_fp8_latent_format_is_refused_in_one_line(checkpoint):
    """The sparse op reads latent rows in the model's dtype only."""
    with pytest.raises(ValueError, match=r"'fp8' encodes attention K and V, which this model does not cache.*use auto"):
        LLM(model=str(checkpoint[1]), dtype="float32", num_blocks=64, kv_cache_dtype="fp8")


def test_the_indexer_keys_share_the_latent_pages(models):
    hf, llm = models
    (pool,) = llm.engine.cache.pools
    attention = [layer.self_attn for layer in llm.engine.model.model.layers]
    assert all(a.indexer.page_group == a.page_group for a in attention)
    assert all(tuple(a.indexer.cache.shape) == (pool.num_blocks, 16, hf.config.index_head_dim) for a in attention)


def causal_selection(step, topk: int, seed: int = 0) -> torch.Tensor:
    """Each query's ``topk`` random positions among those it sees (all of them where it sees fewer, then
    -1), in random order."""
    generator = torch.Generator().manual_seed(seed)
    selected = torch.full((step.q_latent.shape[0], topk), -1, dtype=torch.int32)
    cu = step.meta.cu_seqlens_q.tolist()
    for b, context in enumerate(step.contexts):
        for i, t in enumerate(range(cu[b], cu[b + 1])):
            seen = len(context) - (cu[b + 1] - cu[b]) + i + 1
            row = torch.cat([torch.randperm(seen, generator=generator)[:topk], torch.full((topk,), -1)])[:topk]
            selected[t] = row[torch.randperm(topk, generator=generator)].int()
    return selected


@pytest.mark.parametrize("batch", BATCHES)
def test_sparse_reference_equals_dense_attention_under_the_selection_mask(batch):
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    step = paged_step(q_lens, context_lens, heads=4, rank=32, rope=16, pad_tokens=pad_tokens, pad_seqs=pad_seqs)
    selected = causal_selection(step, TOPK)
    q_latent, q_rope, latent, cache, meta, scale = step.args()
    out = sparse_mla_attention(q_latent, q_rope, latent, cache, meta, scale, selected)
    cu = meta.cu_seqlens_q.tolist()
    for b, context in enumerate(step.contexts):
        rows = slice(cu[b], cu[b + 1])
        mask = torch.zeros(cu[b + 1] - cu[b], len(context), dtype=torch.bool)
        for i, positions in enumerate(selected[rows].long()):
            mask[i, positions[positions >= 0]] = True
        q = torch.cat([step.q_latent[rows], step.q_rope[rows]], dim=-1).double().transpose(0, 1)
        k = context.double().expand(q.shape[0], -1, -1)
        expected = F.scaled_dot_product_attention(q, k, k[..., :32], attn_mask=mask, scale=scale).transpose(0, 1)
        torch.testing.assert_close(out[rows].double(), expected, rtol=1e-5, atol=1e-5)
    assert (out[sum(q_lens) :] == 0).all()  # rows of no sequence


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.usefixtures("cuda_backend")
def test_sparse_kernel_matches_the_reference(batch, dtype):
    """20 heads: two groups of 16, the second part padding; 40 selected rows: two tiles of 32, the second
    part padding."""
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    step = paged_step(q_lens, context_lens, heads=20, rank=32, rope=8, dtype=dtype, pad_tokens=pad_tokens,
                      pad_seqs=pad_seqs, seed=len(q_lens))  # fmt: skip
    selected = causal_selection(step, 40, seed=1)
    q_latent, q_rope, latent, cache, meta, scale = step.args(DEVICE)
    out = sparse_mla.sparse_mla_attention(q_latent, q_rope, latent, cache, meta, scale, selected.to(DEVICE))
    expected = sparse_mla_attention(*step.args(), selected)
    assert_stored(cache, step)
    tol = KERNEL_TOL[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("batch", BATCHES)
def test_indexer_selects_the_best_visible_positions(batch):
    """Against its scores written densely: every position a query sees where it sees at most ``topk``, else
    the ``topk`` of highest ``sum_h w_h relu(scale q_h . k)``; its keys stored at their slots."""
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    heads, dim = 4, 16
    step = paged_step(q_lens, context_lens, heads=1, rank=dim, rope=0, pad_tokens=pad_tokens, pad_seqs=pad_seqs)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(step.q_latent.shape[0], heads, dim, generator=generator)
    weights = torch.randn(q.shape[0], heads, generator=generator)
    _, _, keys, cache, meta, _ = step.args()
    selected = indexer_ops.indexer_topk(q, keys, weights, cache, meta, dim**-0.5, TOPK)
    assert_stored(cache, step)
    cu = meta.cu_seqlens_q.tolist()
    for b, context in enumerate(step.contexts):
        for i, t in enumerate(range(cu[b], cu[b + 1])):
            seen = len(context) - (cu[b + 1] - cu[b]) + i + 1
            scores = weights[t] @ torch.relu(q[t] @ context[:seen].T * dim**-0.5)
            expected = scores.topk(min(TOPK, seen)).indices.sort().values
            got = selected[t]
            assert (got[got < 0] == -1).all() and (got < 0).sum() == TOPK - len(expected)
            assert got[got >= 0].sort().values.tolist() == expected.tolist()
    assert (selected[sum(q_lens) :] == -1).all()


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.usefixtures("cuda_backend")
def test_indexer_kernel_selects_as_the_reference(batch):
    """8 heads of 32 dims (the kernel pads them to a tile of 16), 16 positions a program."""
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    heads, dim = 8, 32
    step = paged_step(q_lens, context_lens, heads=1, rank=dim, rope=0, pad_tokens=pad_tokens, pad_seqs=pad_seqs)
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(step.q_latent.shape[0], heads, dim, generator=generator)
    weights = torch.randn(q.shape[0], heads, generator=generator)
    _, _, keys, cache, meta, _ = step.args(DEVICE)
    got = indexer.indexer_topk(q.to(DEVICE), keys, weights.to(DEVICE), cache, meta, dim**-0.5, TOPK, block_n=16)
    _, _, cpu_keys, cpu_cache, cpu_meta, _ = step.args()
    expected = indexer_ops.indexer_topk(q, cpu_keys, weights, cpu_cache, cpu_meta, dim**-0.5, TOPK)
    assert_stored(cache, step)
    assert got.cpu().sort(dim=-1).values.tolist() == expected.sort(dim=-1).values.tolist()
