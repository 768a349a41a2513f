"""Every architecture of the llama and qwen plugins against HF transformers (fp32, CPU)."""

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

from tests.tiny_models import COMMON, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
    rope_theta=500000.0,
)

CONFIGS = {
    "llama-gqa-llama3-rope": lambda: LlamaConfig(
        **COMMON, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]
    ),
    "llama-tied": lambda: LlamaConfig(
        **{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True, architectures=["LlamaForCausalLM"]
    ),
    "mistral-window-16": lambda: MistralConfig(
        **COMMON, sliding_window=16, tie_word_embeddings=False, architectures=["MistralForCausalLM"]
    ),
    "phi3-fused-partial-rope": lambda: Phi3Config(
        **{**COMMON, "num_key_value_heads": 4},
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        tie_word_embeddings=False,
        architectures=["Phi3ForCausalLM"],
    ),
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
