"""DeepseekV4ForCausalLM against transformers' modeling code (fp32, CPU).

The tiny config has every layer type: a sliding layer, two CSA layers (an entry per 4 tokens, the
indexer keeping 4 of them) and an HCA layer (an entry per 16 tokens), a window of 8, two
hyper-connected streams, a hash-routed first MoE layer. Prompts of 40 to 100 tokens so outgrow the
window many times over, and the indexer selects among up to 25 entries. Sinks, position biases,
the streams' mixing and the hash table are random (transformers initialises them to zeros and
ones). Prefill runs in chunks of 27 tokens, which end inside windows, so windows are pooled from
rows of two steps. The indexer has 16 heads: with few, entries no head scores above zero tie at 0,
and which of them a top-k keeps depends on how many entries it ranks (one step's or the prompt's).
"""

import json
import shutil
import weakref

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4Config
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_output_matches_hf,
    assert_preempted_sequences_match_hf,
    assert_prefill_logits_match,
    assert_prefix_hit_mid_prompt_matches_hf,
    hf_greedy,
    randomize,
    spread_routing,
)
from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams, ops
from xinfer.quant import QuantizedTensor, get_weight_format
from xinfer_deepseek import compressed_ops
from xinfer_deepseek.checkpoint_v4 import decode_e2m1, dequantize, hf_name, hf_names

CHUNK = 27  # prefill chunks that end inside windows of 4 and 16
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
EXPERTS = 8


def deepseek_v4_config(**overrides) -> DeepseekV4Config:
    settings = {key: value for key, value in COMMON.items() if key != "intermediate_size"}  # (moe_intermediate_size's)
    settings |= dict(
        num_hidden_layers=4,
        head_dim=32,
        q_lora_rank=24,
        partial_rotary_factor=0.25,  # 8 rotated dims of 32
        moe_intermediate_size=32,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={CSA: 4, HCA: 16},
        sliding_window=8,
        hc_mult=2,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,  # (with few heads, scores of entries no head matches tie at 0)
        index_head_dim=16,
        index_topk=4,
        swiglu_limit=0.5,  # small enough that the clamp acts on these weights
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
        tie_word_embeddings=False,
        architectures=["DeepseekV4ForCausalLM"],
    )
    return DeepseekV4Config(**{**settings, **overrides})


def randomize_v4(hf: torch.nn.Module, seed: int = 5) -> None:
    """Norms, routers (:func:`randomize`, :func:`spread_routing`), and V4's own parameters that
    transformers initialises to constants: sinks, position biases, the hyper-connections' biases and
    scales, the hash table."""
    randomize(hf)
    spread_routing(hf)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith(("sinks", "position_bias", "_hc.base", "hc_base")):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith(("_hc.scale", "hc_scale")):
                tensor.copy_(1 + 0.3 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, EXPERTS, tensor.shape, generator=generator))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v4")
    hf = save_tiny_model(deepseek_v4_config(), folder)
    randomize_v4(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


def llm_of(folder, **options) -> LLM:
    return LLM(model=str(folder), dtype="float32", **{"num_blocks": 64, "max_num_batched_tokens": CHUNK, **options})


@pytest.fixture(scope="module")
def models(checkpoint):
    hf, folder = checkpoint
    return hf, llm_of(folder)


@pytest.mark.parametrize("length", (5, 100))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    """A 90-token prompt prefilled in three chunks, then decoded: entries pooled across steps."""
    assert_greedy_tokens_and_logprobs_match(*models, 90)


def test_a_prefix_cache_hit_mid_prompt_matches_hf(models):
    assert_prefix_hit_mid_prompt_matches_hf(*models, GREEDY)


def test_preempted_sequences_match_hf(checkpoint):
    hf, folder = checkpoint
    llm = llm_of(folder, num_blocks=7, max_model_len=96)
    assert_preempted_sequences_match_hf(hf, llm, GREEDY)


def test_softmax_scores_are_one_error_naming_the_field(checkpoint, tmp_path):
    """transformers' V4 router takes its score function from ACT2FN, which has no softmax (a KeyError)."""
    _, folder = checkpoint
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax"}))
    with pytest.raises(NotImplementedError, match="scoring_func 'softmax' is not supported"):
        llm_of(tmp_path)


def test_the_indexer_selection_acts(checkpoint):
    """transformers' own tokens change when its indexers keep every entry: the selection matters."""
    hf, _ = checkpoint
    tokens = prompt(90, seed=1)
    sparse, _ = hf_greedy(hf, tokens, NEW_TOKENS)
    indexers = [m for name, m in hf.named_modules() if name.endswith("compressor.indexer")]
    try:
        for indexer in indexers:
            indexer.index_topk = 1000
        dense, _ = hf_greedy(hf, tokens, NEW_TOKENS)
    finally:
        for indexer in indexers:
            indexer.index_topk = 4
    assert dense != sparse


@pytest.mark.parametrize("broken", ("compress_windows", "compressed_indexer_topk"))
def test_wrong_entries_or_selection_change_the_tokens(checkpoint, monkeypatch, broken):
    """Entries pooled as zeros, or each query's first entries instead of the indexer's best: not
    transformers' tokens (so the tests above exercise both)."""
    hf, folder = checkpoint
    reference = getattr(compressed_ops, broken)

    def wrong(*args):
        out = reference(*args)
        if broken == "compress_windows":
            return torch.zeros_like(out)
        first = torch.arange(out.shape[1], dtype=out.dtype).expand_as(out)
        return torch.where(out >= 0, first, -1)

    monkeypatch.setattr(compressed_ops, broken, wrong)
    monkeypatch.setattr(ops, "_plugin_functions", weakref.WeakKeyDictionary())  # ops resolved anew
    tokens = prompt(90, seed=1)
    out = llm_of(folder).generate([tokens], GREEDY)[0].outputs[0]
    assert out.token_ids != hf_greedy(hf, tokens, NEW_TOKENS)[0]


def test_each_kind_has_its_pool(models):
    """The window's rows and the open windows' projections in windowed pools; the entries, one row
    per 4 tokens (CSA: 4 rows per block of 16) or per 16 (HCA: one per block), in the full pool."""
    _, llm = models
    attention = [layer.self_attn for layer in llm.engine.model.model.layers]
    pools = {pool.window: pool for pool in llm.engine.cache.pools}
    assert set(pools) == {None, 8, 16}
    csa, hca = attention[1].compressor, attention[2].compressor
    blocks = pools[None].num_blocks
    assert tuple(csa.entries.cache.shape) == (blocks, 4, 32)
    assert tuple(csa.indexer.entries.cache.shape) == (blocks, 4, 16)
    assert tuple(hca.entries.cache.shape) == (blocks, 1, 32)
    assert tuple(attention[0].cache.shape) == (pools[8].num_blocks, 16, 32)
    assert tuple(hca.open_windows.cache.shape) == (pools[16].num_blocks, 16, 2 * 32)
    assert tuple(csa.open_windows.cache.shape) == (pools[8].num_blocks, 16, 4 * 32)


def test_mxfp4_decode_matches_transformers():
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (6, 32), generator=generator, dtype=torch.int8)
    scales = torch.randint(120, 135, (6, 2), generator=generator, dtype=torch.uint8)
    expected = Fp8Dequantize(None)._dequantize_one(packed, scales, torch.float32)
    torch.testing.assert_close(dequantize(packed, scales), expected, rtol=0, atol=0)
    assert decode_e2m1(torch.tensor([0x7F, 0x1A], dtype=torch.uint8)).tolist() == [-6.0, 6.0, -1.0, 0.5]


def test_mxfp4_scales_of_another_shape_are_named():
    weights = [("layers.0.ffn.experts.0.w1.weight", torch.zeros(4, 32, dtype=torch.int8)),
               ("layers.0.ffn.experts.0.w1.scale", torch.zeros(4, 3, dtype=torch.uint8))]  # fmt: skip
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight: MXFP4 codes \(4, 32\) and scales \(4, 3\)"):
        list(hf_names(weights))


def test_fp8_blocks_decode_matches_transformers():
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(8, 12, generator=generator).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 3, generator=generator)
    expected = Fp8Dequantize(None)._dequantize_one(weight, scales, torch.float32)
    torch.testing.assert_close(dequantize(weight, scales), expected, rtol=0, atol=0)


def quantize_mxfp4(weight: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes and scales for a weight of ``weight``'s shape (the values are replaced)."""
    rows, cols = weight.shape
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=generator, dtype=torch.int8)
    scales = torch.randint(120, 126, (rows, cols // 32), generator=generator, dtype=torch.uint8)
    return packed, scales


def mxfp4_checkpoint(folder):
    """DeepSeek's own checkpoint of a tiny V4 in ``folder``: its names without transformers' ``model.`` prefix, the
    routed experts in MXFP4 (a hidden size of 64: two scale blocks per row of gate and up, one of down), an MTP
    tensor; and transformers' model with the experts' values."""
    config = deepseek_v4_config(num_hidden_layers=2, layer_types=["sliding_attention", CSA])
    config.mlp_layer_types = ["hash_moe", "moe"]
    hf = save_tiny_model(config, folder)
    randomize_v4(hf)
    tensors = {}
    generator = torch.Generator().manual_seed(3)
    hf.save_pretrained(folder, safe_serialization=True)
    for name, tensor in load_file(folder / "model.safetensors").items():
        name = name.removeprefix("model.").replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")
        if ".experts." in name and name.endswith(("w1.weight", "w2.weight", "w3.weight")):
            packed, scales = quantize_mxfp4(tensor, generator)
            tensors[name], tensors[name.replace(".weight", ".scale")] = packed, scales
            layer, expert, projection = _expert_of(name)
            experts = hf.model.layers[layer].mlp.experts
            target = {"w1": experts.gate_up_proj[expert, :32], "w3": experts.gate_up_proj[expert, 32:],
                      "w2": experts.down_proj[expert]}[projection]  # fmt: skip
            with torch.no_grad():
                target.copy_(dequantize(packed, scales))
        else:
            tensors[name] = tensor
    tensors["mtp.0.emb.weight"] = torch.ones(3)
    assert "norm.weight" in tensors and "head.weight" in tensors and "hc_head_fn" in tensors
    save_file(tensors, folder / "model.safetensors")
    return hf


def test_deepseeks_own_checkpoint_with_mxfp4_experts_and_an_mtp_layer(tmp_path, caplog):
    """The experts stay packed and compute what transformers computes with their values, and the MTP tensor is
    kept."""
    hf = mxfp4_checkpoint(tmp_path)
    with caplog.at_level("INFO"):
        llm = llm_of(tmp_path)
    assert "kept 48 MXFP4 weights packed" in caplog.text
    experts = [m for m in llm.engine.model.modules() if hasattr(m, "w13")]
    assert experts and all(isinstance(w, QuantizedTensor) and w.format.name == "mxfp4" for m in experts
                           for w in (m.w13, m.w2))  # fmt: skip
    assert list(llm.engine.model.mtp) == ["mtp.0.emb.weight"]
    tokens = prompt(40, seed=2)
    out = llm.generate([tokens], GREEDY)[0].outputs[0]
    assert_output_matches_hf(hf, tokens, out, NEW_TOKENS)


def test_isq_w2_packs_the_mxfp4_experts_again_from_their_values(tmp_path):
    """``--isq w2`` re-packs the MXFP4 experts once loaded, from their values (rows of 64 and 32 values: not whole
    Q2_K super-blocks, so in Q4_0, llama.cpp's fallback); every other weight is as without it; the model runs."""
    mxfp4_checkpoint(tmp_path)
    kept = dict(llm_of(tmp_path).engine.model.named_parameters())
    llm = llm_of(tmp_path, isq="w2")
    repacked = 0
    for name, weight in llm.engine.model.named_parameters():
        original = kept[name]
        if isinstance(original, QuantizedTensor) and original.format.name == "mxfp4":
            assert weight.format.name == "q4_0" and weight.logical_shape == original.logical_shape, name
            want = torch.cat([get_weight_format("q4_0").quantize(original.select(e).dequantize())
                              for e in range(original.logical_shape[0])])  # fmt: skip
            assert torch.equal(weight.raw.flatten(0, -2), want), name
            repacked += 1
        else:
            assert type(weight) is type(original) and torch.equal(weight, original), name
    assert repacked == 2 * 2  # w13 and w2 of both layers' experts
    assert len(llm.generate([prompt(12)], GREEDY)[0].outputs[0].token_ids) == NEW_TOKENS


def _expert_of(name: str) -> tuple[int, int, str]:
    parts = name.split(".")  # layers.{i}.ffn.experts.{e}.{w}.weight
    return int(parts[1]), int(parts[4]), parts[5]


@pytest.mark.parametrize(
    ("deepseek", "transformers"),
    [
        ("layers.3.attn.indexer.compressor.norm.weight", "model.layers.3.self_attn.compressor.indexer.kv_norm.weight"),
        ("layers.3.attn.indexer.wq_b.weight", "model.layers.3.self_attn.compressor.indexer.q_b_proj.weight"),
        ("layers.3.attn.norm.weight", "model.layers.3.self_attn.kv_norm.weight"),
        ("layers.0.ffn.gate.bias", "model.layers.0.mlp.gate.e_score_correction_bias"),
        ("layers.0.hc_ffn_scale", "model.layers.0.ffn_hc.scale"),
        ("model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_proj.weight"),
    ],
)
def test_deepseeks_names(deepseek, transformers):
    assert hf_name(deepseek) == transformers


def test_hca_entries_spanning_blocks_match_hf(tmp_path):
    """An entry per 32 tokens, two blocks of 16 (one row per block, the second block's used): greedy
    tokens over chunked prefill, and a prefix-cache hit of 32 tokens that serves entry 0 while the
    prompt's second window is pooled anew."""
    hf = save_tiny_model(deepseek_v4_config(compress_rates={CSA: 4, HCA: 32}), tmp_path)
    randomize_v4(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = llm_of(tmp_path)
    hca = llm.engine.model.model.layers[2].self_attn.compressor
    assert hca.entries.cache.shape[1] == 1
    assert_greedy_tokens_and_logprobs_match(hf, llm, 90)
    assert_prefix_hit_mid_prompt_matches_hf(hf, llm, GREEDY)
