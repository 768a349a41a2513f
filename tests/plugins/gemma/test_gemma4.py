"""Gemma4ForCausalLM against transformers' modeling code (fp32, CPU): a dense model with sliding
and global layers (their own head dims and KV heads, values from the keys on global layers,
proportional rope), an E-model (per-layer embeddings, the last layers reading earlier layers'
caches, double-wide MLPs there) and the MoE variant (a dense MLP beside the experts)."""

import pytest
import torch
from transformers import Gemma4TextConfig

from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    randomize,
)
from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.cache.specs import caching_layers

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
DENSE = dict(
    COMMON,
    num_hidden_layers=len(LAYER_TYPES),
    layer_types=LAYER_TYPES,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    sliding_window=16,
    hidden_size_per_layer_input=0,
    final_logit_softcapping=30.0,
    tie_word_embeddings=True,
    architectures=["Gemma4ForCausalLM"],
)
E_MODEL = dict(  # the last two layers (one of each kind) read the caches of layers 1 and 2
    attention_k_eq_v=False, num_global_key_value_heads=None, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=COMMON["vocab_size"], num_kv_shared_layers=2, use_double_wide_mlp=True,
)  # fmt: skip
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32)


def gemma4_config(**overrides) -> Gemma4TextConfig:
    return Gemma4TextConfig(**{**DENSE, **overrides})


CONFIGS = {
    "dense": gemma4_config,
    "e-model": lambda: gemma4_config(**E_MODEL),
    "moe": lambda: gemma4_config(**MOE),
}


def randomize_gemma4(model: torch.nn.Module) -> None:
    """Norms, layer scalars and the router's scales away from their initial ones, so that a scale
    loaded into the wrong place, or not applied, changes the output."""
    randomize(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith(("router.scale", "router.per_expert_scale")):
                tensor.copy_(1.0 + 0.5 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("router.proj.weight"):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=generator))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(CONFIGS[request.param](), folder)
    randomize_gemma4(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=32)


@pytest.mark.parametrize("length", (3, 17, 61))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_tokens_and_logprobs_match_hf(models, length):
    assert_greedy_tokens_and_logprobs_match(*models, length)


def test_kv_shared_layers_cache_nothing(models):
    hf, llm = models
    config = hf.config
    assert len(caching_layers(llm.engine.model)) == config.num_hidden_layers - config.num_kv_shared_layers


@pytest.mark.parametrize("models", ["moe"], indirect=True)  # the config with a router
def test_routing_spreads_over_the_experts(models):
    hf, _ = models
    chosen = []
    hooks = [layer.router.register_forward_hook(lambda _m, _i, out: chosen.append(out[2])) for layer in hf.model.layers]
    try:
        with torch.inference_mode():
            hf(torch.tensor([prompt(61)]))
    finally:
        for hook in hooks:
            hook.remove()
    assert all(ids.unique().numel() >= hf.config.num_experts * 3 // 4 for ids in chosen)


def test_a_batch_of_prompts_matches_hf_prompt_by_prompt(models):
    # KV-shared layers read their source's pages of each sequence: a batch mixes sequences' pages
    hf, llm = models
    prompts = [prompt(length, seed=2) for length in (7, 40, 23)]
    expected = [
        hf.generate(torch.tensor([tokens]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(tokens) :]
        for tokens in prompts
    ]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [out.outputs[0].token_ids for out in outputs] == [tokens.tolist() for tokens in expected]
