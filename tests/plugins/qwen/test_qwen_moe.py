"""Qwen2MoeForCausalLM and Qwen3MoeForCausalLM against HF transformers' modeling code (fp32, CPU)."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from tests.tiny_models import COMMON, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.loading.weights import MissingWeightsError

EXPERTS = dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, num_hidden_layers=3)
CONFIGS = {
    # layer 1 dense (mlp_only_layers); renormalized top-k
    "qwen3-moe": lambda: Qwen3MoeConfig(
        **{**COMMON, **EXPERTS}, head_dim=32, norm_topk_prob=True, mlp_only_layers=[1],
        tie_word_embeddings=False, architectures=["Qwen3MoeForCausalLM"],
    ),
    # every other layer sparse (decoder_sparse_step 2); raw top-k; a gated shared expert
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **{**COMMON, **EXPERTS}, decoder_sparse_step=2, norm_topk_prob=False, shared_expert_intermediate_size=48,
        tie_word_embeddings=False, architectures=["Qwen2MoeForCausalLM"],
    ),
}  # fmt: skip
PROMPT_LENGTHS = (3, 17, 61)


def _spread_routers(model: torch.nn.Module) -> None:
    """Router weights far from HF's near-zero init, so that each token's experts are
    clear winners and tokens spread over many of them."""
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.data.copy_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(CONFIGS[request.param](), folder)
    _spread_routers(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64), folder


def test_tokens_spread_over_the_experts(models):
    hf = models[0]
    layer = next(layer for layer in hf.model.layers if hasattr(layer.mlp, "gate"))
    hidden = torch.randn(64, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    _, _, experts = layer.mlp.gate(hidden)
    assert experts.unique().numel() >= hf.config.num_experts * 3 // 4


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_prefill_log_probs_match_hf(models, length):
    hf, llm, _ = models
    tokens = prompt(length)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].log_softmax(-1)
    got = prefill_logits(llm.engine, tokens).float().log_softmax(-1)
    error = (got - expected).abs().max()
    assert error <= 1e-4, f"max|diff| of log-probs = {error:.2e}"


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_greedy_tokens_match_hf_generate(models, length):
    hf, llm, _ = models
    tokens = prompt(length, seed=1)
    expected = hf.generate(torch.tensor([tokens]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[
        0, length:
    ].tolist()
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected


def test_a_missing_expert_tensor_is_named(models, tmp_path):
    _, _, folder = models
    for file in ("config.json", "generation_config.json"):
        if (folder / file).exists():
            (tmp_path / file).write_text((folder / file).read_text())
    tensors = load_file(folder / "model.safetensors")
    name = next(name for name in tensors if name.endswith("mlp.experts.5.up_proj.weight"))
    del tensors[name]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError) as error:
        LLM(model=str(tmp_path), dtype="float32", num_blocks=16)
    assert "lacks 1 weight(s)" in str(error.value) and name in str(error.value)
