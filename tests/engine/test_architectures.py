"""Every architecture of the llama and qwen plugins against HF transformers (fp32, CPU)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from tests.plugins.hf_parity import assert_output_matches_hf, randomized_model
from tests.tiny_models import COMMON, phi3_longrope_config, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
    rope_theta=500000.0,
)
YARN_UNTRUNCATED = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, truncate=False,
    beta_fast=16.0, beta_slow=2.0,
)  # fmt: skip

CONFIGS = {
    "llama-gqa-llama3-rope": lambda: LlamaConfig(
        **COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]
    ),
    "llama-tied-gelu": lambda: LlamaConfig(
        **{**COMMON, "num_key_value_heads": 4},
        hidden_act="gelu",
        tie_word_embeddings=True,
        architectures=["LlamaForCausalLM"],
    ),
    "llama-dynamic-rope-biases-head-8": lambda: LlamaConfig(
        **COMMON,
        head_dim=8,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
        architectures=["LlamaForCausalLM"],
    ),
    # YaRN's correction range kept fractional (``truncate`` False, as gpt-oss), betas of its own
    "mistral-window-16-yarn-untruncated": lambda: MistralConfig(
        **COMMON,
        sliding_window=16,
        tie_word_embeddings=False,
        rope_parameters=dict(YARN_UNTRUNCATED),
        architectures=["MistralForCausalLM"],
    ),
    # transformers' Llama rotates the whole head whatever partial_rotary_factor says
    "llama-partial-rotary-factor-ignored": lambda: LlamaConfig(
        **COMMON,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    ),
    "phi3-fused-partial-rope": lambda: Phi3Config(
        **{**COMMON, "num_key_value_heads": 4},
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        tie_word_embeddings=False,
        architectures=["Phi3ForCausalLM"],
    ),
    # LongRoPE (Phi-3.5, Phi-4-mini) trained at 32 positions: the 3- and 17-token prompts start with the short
    # factors and their 32 new tokens cross into the long ones; the 61-token prompt is long from the start
    "phi3-longrope-partial": phi3_longrope_config,
    "qwen2-bias-tied": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True, architectures=["Qwen2ForCausalLM"]),
    "qwen3-qknorm": lambda: Qwen3Config(
        **{**COMMON, "num_key_value_heads": 1},
        head_dim=32,
        tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    ),
}
PROMPT_LENGTHS = (3, 17, 61)  # the longest spans four 16-token KV blocks


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(CONFIGS[request.param](), folder)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_logits_match_hf(models, length):
    hf, llm = models
    tokens = prompt(length)
    expected = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    error = (got - expected).abs().max() / expected.abs().max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e}"


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_tokens_match_hf_generate(models, length):
    hf, llm = models
    tokens = prompt(length, seed=1)
    expected = hf.generate(torch.tensor([tokens]), max_new_tokens=32, min_new_tokens=32, do_sample=False)[
        0, length:
    ].tolist()
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    assert out[0].outputs[0].finish_reason == "length"


def test_longrope_recomputes_a_sequence_that_passes_the_trained_context(tmp_path):
    """LongRoPE trained at 32 positions. A 20-token prompt with 4 new tokens stays short; a 40-token prompt sharing
    its first 16-token block does not take that block from the prefix cache (keys turned by the short factors);
    the 20-token prompt with 24 new tokens passes 32 positions, where transformers' ``generate`` recomputes the
    whole sequence with the long factors, and so does xinfer (again without the short block); two 40-token
    prompts in steps of 48 tokens are not cut before position 32 (the second waits for the budget). Each matches
    transformers' tokens and log-probabilities."""
    hf, llm = randomized_model(CONFIGS["phi3-longrope-partial"](), tmp_path)
    assert llm.engine.model.context_switch == 32
    short = prompt(20, seed=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    assert_output_matches_hf(hf, short, llm.generate([short], params)[0].outputs[0], 4)

    long = short + prompt(20, seed=2)
    out = llm.generate([long], params)[0]
    assert out.num_cached_tokens == 0
    assert_output_matches_hf(hf, long, out.outputs[0], 4)

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    assert_output_matches_hf(hf, short, llm.generate([short], params)[0].outputs[0], 24)

    chunked = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, max_num_batched_tokens=48)
    prompts = [prompt(40, seed=3), prompt(40, seed=4)]
    for tokens, out in zip(prompts, chunked.generate(prompts, params)):
        assert_output_matches_hf(hf, tokens, out.outputs[0], 24)


def test_longrope_without_recompute_keeps_a_long_prompts_keys_long_in_chunks_and_apart_in_the_prefix_cache(tmp_path):
    """Qwen3 with LongRoPE trained at 16 positions (transformers turns every position of a longer prompt by the
    long factors, and a shorter one's by the short ones, keys cached before staying as they are): a 29-token
    prompt prefilled in steps of 8 tokens (raised past 16), and a 26-token prompt after a 16-token one sharing
    its first block (short keys, which the longer prompt must not take), match transformers."""
    rope = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                short_factor=[1.0, 1.2, 1.5, 1.9], long_factor=[2.0, 5.0, 9.0, 17.0])  # fmt: skip
    config = Qwen3Config(**{**COMMON, "hidden_size": 32, "num_attention_heads": 4}, head_dim=8, rope_parameters=rope,
                         tie_word_embeddings=False, architectures=["Qwen3ForCausalLM"])  # fmt: skip
    hf, _ = randomized_model(config, tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    long = prompt(29, seed=7)
    assert_output_matches_hf(hf, long, llm.generate([long], params)[0].outputs[0], 6)

    short = prompt(16, seed=8)
    llm.generate([short], SamplingParams(temperature=0, max_tokens=1))  # its block cached, short keys
    longer = short + prompt(10, seed=9)
    out = llm.generate([longer], params)[0]
    assert out.num_cached_tokens == 0
    assert_output_matches_hf(hf, longer, out.outputs[0], 6)


TOP_LEVEL_ROPES = {
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0),
    "longrope": dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + i / 10 for i in range(8)],
                     long_factor=[1.5 + i for i in range(8)]),
    "llama3": LLAMA3_ROPE,
}  # fmt: skip


@pytest.mark.parametrize("rope", sorted(TOP_LEVEL_ROPES))
def test_a_top_level_original_max_position_embeddings_wins_over_the_rope_parameters(tmp_path, rope):
    """A config.json with the trained context at its top level only (as Phi-3 and other long-context checkpoints
    write it): transformers takes it over the one its config loading puts in the rope parameters (512, the
    max positions), and so does xinfer; the 40-token prompt passes it (LongRoPE's long factors)."""
    config = LlamaConfig(**COMMON, rope_parameters=TOP_LEVEL_ROPES[rope], architectures=["LlamaForCausalLM"])
    save_tiny_model(config, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    written["rope_parameters"].pop("original_max_position_embeddings")
    (tmp_path / "config.json").write_text(json.dumps({**written, "original_max_position_embeddings": 16}))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.config.rope_parameters["original_max_position_embeddings"] == 16
    tokens = prompt(40)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(LLM(model=str(tmp_path), dtype="float32", num_blocks=64).engine, tokens)
    error = (got - expected).abs().max() / expected.abs().max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e}"


def test_generation_stops_at_every_eos_of_generation_config_without_a_tokenizer(tmp_path):
    """A checkpoint folder with no tokenizer whose generation_config.json lists two EOS ids (config.json
    none): xinfer's greedy generation stops where transformers' ``generate`` of that folder does."""
    hf, _ = randomized_model(Qwen2Config(**COMMON, architectures=["Qwen2ForCausalLM"]), tmp_path)
    tokens = prompt(11, seed=2)
    free = hf.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False)[0, len(tokens) :].tolist()
    eos = [free[5], (free[5] + 1) % COMMON["vocab_size"]]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    expected = reference.generate(torch.tensor([tokens]), max_new_tokens=12, do_sample=False)[0, len(tokens) :]
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert len(expected) <= 6 and out.token_ids == expected.tolist() and out.finish_reason == "stop"
    # vLLM: with no tokenizer's EOS, generation_config's are stop token ids, each the stop_reason
    assert out.stop_reason == out.token_ids[-1]


YARN_4X = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


def test_hf_overrides_yarn_serves_past_max_position_embeddings(tmp_path):
    """Qwen3's YaRN recipe through ``hf_overrides`` (vLLM's flag), config.json untouched: a model of 64 positions
    scaled 4 times serves 256 (as vLLM derives it, the trained context times the factor), with transformers'
    logits for the same config at a prompt past its 64 positions."""
    config = Qwen3Config(**{**COMMON, "max_position_embeddings": 64}, head_dim=16, architectures=["Qwen3ForCausalLM"])
    save_tiny_model(config, tmp_path / "model")
    llm = LLM(model=str(tmp_path / "model"), dtype="float32", num_blocks=64, hf_overrides={"rope_scaling": YARN_4X})
    assert llm.engine.max_model_len == 256
    (tmp_path / "edited").mkdir()
    (tmp_path / "edited" / "model.safetensors").symlink_to(tmp_path / "model" / "model.safetensors")
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    written["rope_parameters"] = {**written["rope_parameters"], **YARN_4X}
    (tmp_path / "edited" / "config.json").write_text(json.dumps(written))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "edited", dtype=torch.float32, attn_implementation="eager")
    tokens = prompt(200)
    with torch.inference_mode():
        expected = hf.eval()(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    error = (got - expected).abs().max() / expected.abs().max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e}"


def test_a_max_model_len_past_yarns_context_is_refused_naming_it(tmp_path):
    config = Qwen3Config(**{**COMMON, "max_position_embeddings": 64}, head_dim=16, architectures=["Qwen3ForCausalLM"])
    save_tiny_model(config, tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len 257 is more than the model's context under YaRN \(256: "):
        LLM(model=str(tmp_path), dtype="float32", max_model_len=257, hf_overrides={"rope_scaling": YARN_4X})
