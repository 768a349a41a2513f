"""Each KV format through the engine on the CPU backend: the cache path keeps its
guarantees (prefix caching, chunked prefill, preemption give identical tokens within
one format), the planner counts real bytes, and real weights still answer."""

import pytest

from tests.tiny_models import prompt
from xinfer import LLM, SamplingParams
from xinfer.cache.allocate import attention_layers, bytes_per_block

QUANTIZED = ["fp8", "turbo8", "turbo4", "turbo3"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_cache_paths_agree_within_a_format(model_dir, fmt):
    reference = LLM(model=model_dir, dtype="float32", num_blocks=256, kv_cache_dtype=fmt, enable_prefix_caching=False)
    prompts = [prompt(30 + 11 * i, seed=i) for i in range(6)]
    expected = tokens(reference, prompts)

    chunked = LLM(model=model_dir, dtype="float32", num_blocks=256, kv_cache_dtype=fmt, max_num_batched_tokens=24)
    assert tokens(chunked, prompts) == expected

    small = LLM(model=model_dir, dtype="float32", num_blocks=10, max_model_len=128, kv_cache_dtype=fmt)
    assert tokens(small, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) == tokens(
        reference, prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    )
    assert small.engine.stats().num_preemptions > 0

    shared = prompt(70, seed=42)
    cached = LLM(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype=fmt)
    tokens(cached, [shared + prompt(5, seed=1)])
    second = cached.generate([shared + prompt(9, seed=2)], GREEDY)[0]
    assert second.num_cached_tokens == 64
    assert second.outputs[0].token_ids == tokens(reference, [shared + prompt(9, seed=2)])[0]


def test_quantized_cache_stays_close_to_auto(model_dir):
    auto = LLM(model=model_dir, dtype="float32", num_blocks=64)
    fp8 = LLM(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype="fp8")
    prompts = [prompt(40, seed=i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    same = sum(a[0] == b[0] for a, b in zip(tokens(auto, prompts, params), tokens(fp8, prompts, params)))
    assert same >= 3


def test_planner_counts_real_bytes(model_dir):
    budget_blocks = {}
    for fmt in ["auto", *QUANTIZED]:
        llm = LLM(model=model_dir, dtype="bfloat16", num_blocks=4, max_model_len=64, kv_cache_dtype=fmt)
        engine = llm.engine
        per_block = bytes_per_block(engine.model, 16, engine.dtype, engine.kv_format)
        layers = [layer.cache for layer in attention_layers(engine.model)]
        allocated = sum(t.numel() * t.element_size() for c in layers for t in c.tensors.values())
        assert allocated == 4 * per_block
        budget_blocks[fmt] = (1 << 30) // per_block
    assert budget_blocks["turbo3"] > budget_blocks["turbo4"] > budget_blocks["turbo8"] > budget_blocks["fp8"]
    assert budget_blocks["fp8"] > 1.7 * budget_blocks["auto"]  # head_dim 32: scales weigh more


QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.mark.parametrize("fmt", ["fp8", "turbo8"])
def test_default_model_still_knows_the_capital_of_france(fmt):
    llm = LLM(kv_cache_dtype=fmt)
    out = llm.chat([{"role": "user", "content": QUESTION}], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text


@pytest.mark.parametrize("fmt", ["fp8", "turbo4"])
def test_a_rotating_format_on_heads_of_no_power_of_two_dims_is_refused_in_one_line(tmp_path, fmt):
    """Phi-3-mini's heads have 96 dims: the formats rotate each head by a Walsh-Hadamard transform, which takes a
    power of two. It failed on the first step with a bare AssertionError ('96'); now start-up refuses it."""
    from transformers import LlamaConfig

    from tests.tiny_models import COMMON, save_tiny_model

    save_tiny_model(LlamaConfig(**dict(COMMON, head_dim=96), architectures=["LlamaForCausalLM"]), tmp_path)
    with pytest.raises(
        ValueError, match=rf"'{fmt}' rotates each head .* power-of-two head dim; this model's .* 96 dims"
    ):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64, kv_cache_dtype=fmt)
    assert LLM(model=str(tmp_path), dtype="float32", num_blocks=64).generate([prompt(5)])[0].outputs[0].token_ids
