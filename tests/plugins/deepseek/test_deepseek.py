"""DeepseekV3ForCausalLM against transformers' modeling code (fp32, CPU), which computes attention in the
expanded form: multi-head latent attention absorbed over a latent cache, q-LoRA, interleaved rotary,
group-limited routing after a dense layer. Prompts run longer than a block and than the prefill chunk; a
prompt hitting the prefix cache mid-way and preempted sequences give transformers' tokens too. The
checkpoint's MTP layer is skipped; a turbo KV format is refused (test_fp8_latent.py has fp8). test_config_variants.py has the other
architectures and options."""

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.plugins.deepseek.configs import deepseek_v3_config
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_missing_tensor_is_named,
    assert_preempted_sequences_match_hf,
    assert_prefill_logits_match,
    assert_prefix_hit_mid_prompt_matches_hf,
    randomize,
    spread_routing,
)
from tests.tiny_models import save_tiny_model
from xinfer import LLM, SamplingParams

CHUNK = 32  # prefill chunk: the 40-token prompts take two steps
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def save_with_mtp_layer(hf, folder) -> None:
    """The checkpoint as DeepSeek-V3's: a copy of the last layer stored as layer ``num_hidden_layers``
    with its NextN projections, which transformers' model does not build."""
    hf.save_pretrained(folder, safe_serialization=True)
    last, mtp = hf.config.num_hidden_layers - 1, hf.config.num_hidden_layers
    tensors = load_file(folder / "model.safetensors")
    extra = {
        name.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith(f"model.layers.{last}.")
    }
    extra[f"model.layers.{mtp}.eh_proj.weight"] = torch.randn(hf.config.hidden_size, 2 * hf.config.hidden_size)
    save_file(extra, folder / "model-mtp.safetensors")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v3")
    hf = save_tiny_model(deepseek_v3_config(), folder)
    randomize(hf)
    spread_routing(hf)
    save_with_mtp_layer(hf, folder)
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


def test_a_prefix_cache_hit_mid_prompt_matches_hf(models):
    assert_prefix_hit_mid_prompt_matches_hf(*models, GREEDY)


def test_preempted_sequences_match_hf(checkpoint):
    hf, folder = checkpoint
    llm = LLM(model=str(folder), dtype="float32", num_blocks=7, max_model_len=96, max_num_batched_tokens=CHUNK)
    assert_preempted_sequences_match_hf(hf, llm, GREEDY)


def test_mtp_layer_skipped_with_a_log_line(checkpoint, caplog):
    hf, folder = checkpoint
    with caplog.at_level(logging.INFO, logger="xinfer.loading.mtp"):
        LLM(model=str(folder), dtype="float32", num_blocks=64)
    assert [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()] == [
        f"skipping the checkpoint's MTP layers (model.layers.{hf.config.num_hidden_layers} and on): "
        "xinfer does not run them"
    ]


def test_the_cache_holds_the_latent_and_rope_key_per_token_and_layer(models):
    hf, llm = models
    config = hf.config
    (pool,) = llm.engine.cache.pools
    caches = [layer.self_attn.cache for layer in llm.engine.model.model.layers]
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert all(tuple(cache.shape) == (pool.num_blocks, 16, width) for cache in caches)


@pytest.mark.parametrize("kv_cache_dtype", ["turbo4"])
def test_a_quantized_kv_format_is_refused_in_one_line(tmp_path, kv_cache_dtype):
    save_tiny_model(deepseek_v3_config(), tmp_path)
    with pytest.raises(ValueError, match=f"'{kv_cache_dtype}' encodes attention K and V, which this model does not"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv_lora_rank", [30, 260], ids=["not 4-aligned", "not in equal groups of 128"])
def test_fp8_is_refused_for_a_latent_rank_with_no_fp8_row(tmp_path, kv_lora_rank):
    save_tiny_model(deepseek_v3_config(kv_lora_rank=kv_lora_rank), tmp_path)
    with pytest.raises(ValueError, match=r"'fp8' encodes attention K and V, which this model does not.*use auto$"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64, kv_cache_dtype="fp8")


def test_a_missing_up_projection_is_named(tmp_path):
    save_tiny_model(deepseek_v3_config(), tmp_path)
    dropped = "model.layers.1.self_attn.kv_b_proj.weight"
    assert_missing_tensor_is_named(tmp_path, dropped, "model.layers.1.self_attn.kv_b_proj.k_b_proj.weight")


@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["q_proj", "q-LoRA"])
def test_a_missing_latent_projection_bias_is_named(tmp_path, q_lora_rank):
    """The latent's projection and the first query projection are one GEMM (qkv_a_proj): a bias the checkpoint
    lacks is named; q_proj's, which transformers never has, is not asked for."""
    save_tiny_model(deepseek_v3_config(q_lora_rank=q_lora_rank, attention_bias=True), tmp_path)
    dropped = "model.layers.1.self_attn.kv_a_proj_with_mqa.bias"
    assert_missing_tensor_is_named(tmp_path, dropped, dropped)
