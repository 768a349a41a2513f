"""Qwen2MoeForCausalLM and Qwen3MoeForCausalLM against HF transformers' modeling code (fp32, CPU)."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2MoeConfig, Qwen3MoeConfig

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.converted_gguf import add_tiny_vocabulary
from tests.plugins.hf_parity import randomize, spread_routing
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
    # every other layer sparse (decoder_sparse_step 2); raw top-k; a gated shared expert of twice an expert's
    # size, run as two more routed experts (MoE.finish_loading; the GGUF configs below keep one that is not)
    "qwen2-moe": lambda: Qwen2MoeConfig(
        **{**COMMON, **EXPERTS}, decoder_sparse_step=2, norm_topk_prob=False, shared_expert_intermediate_size=64,
        tie_word_embeddings=False, architectures=["Qwen2MoeForCausalLM"],
    ),
}  # fmt: skip
PROMPT_LENGTHS = (3, 17, 61)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(CONFIGS[request.param](), folder)
    spread_routing(hf)
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


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's in-memory experts (``gate_up_proj`` [E, 2I, H], ``down_proj``) as llama.cpp's
    converter stacks them: one [E, ., .] tensor per projection."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[name.replace("gate_up_proj", "up_proj.weight")] = up
        elif name.endswith("experts.down_proj"):
            out[name + ".weight"] = tensor
        else:
            out[name] = tensor
    return out


def write_moe_gguf(model, arch: str, path) -> None:
    """A GGUF of ``model`` as llama.cpp's converter writes one (every tensor F32)."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(model.model.layers[0].self_attn.head_dim)
    writer.add_value_length(model.model.layers[0].self_attn.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    add_tiny_vocabulary(writer, config.vocab_size, pre="qwen2")
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers
    )
    for hf_name, tensor in _stacked_experts(model.state_dict()).items():
        base, _, suffix = hf_name.rpartition(".")
        values = tensor.float().numpy()
        if hf_name.endswith("shared_expert_gate.weight"):
            values = values[0]  # llama.cpp's converter writes it as a vector
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", values, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


GGUF_CONFIGS = {
    # llama.cpp has no mlp_only_layers or decoder_sparse_step, and hard-codes norm_topk_prob (qwen3moe: on)
    "qwen3moe": lambda **o: Qwen3MoeConfig(**{**COMMON, **EXPERTS, "head_dim": 32, "norm_topk_prob": True,
                                             "architectures": ["Qwen3MoeForCausalLM"], **o}),
    "qwen2moe": lambda **o: Qwen2MoeConfig(**{**COMMON, **EXPERTS, "norm_topk_prob": False,
                                             "shared_expert_intermediate_size": 48,
                                             "architectures": ["Qwen2MoeForCausalLM"], **o}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(GGUF_CONFIGS))
def gguf_models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(GGUF_CONFIGS[request.param](), folder / "hf")
    randomize(hf)
    spread_routing(hf)
    write_moe_gguf(hf, request.param, folder / "tiny.gguf")
    return hf, LLM(model=str(folder / "tiny.gguf"), dtype="float32", num_blocks=64), folder / "tiny.gguf"


def test_gguf_with_stacked_experts_runs_like_the_original(gguf_models):
    hf, llm, _ = gguf_models
    tokens = prompt(29)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].log_softmax(-1)
    got = prefill_logits(llm.engine, tokens).float().log_softmax(-1)
    assert (got - expected).abs().max() <= 1e-4


def test_llama_cpp_reads_the_gguf_alike(gguf_models):
    _, llm, path = gguf_models
    assert_llama_cpp_agrees(llm, path)


BIASED = {
    "qwen3moe with attention biases": ("qwen3moe", {"attention_bias": True}),
    "qwen2moe without q/k/v biases": ("qwen2moe", {"qkv_bias": False}),
}


@pytest.mark.parametrize("case", sorted(BIASED))
def test_a_gguf_s_attention_biases_are_read_from_its_tensors(tmp_path, case):
    """A config field switches them in transformers; a GGUF shows them as tensors present or not. xinfer ran a
    qwen3moe file with biases without them (llama.cpp refuses it: more tensors than it expects)."""
    arch, overrides = BIASED[case]
    hf = save_tiny_model(GGUF_CONFIGS[arch](**overrides), tmp_path / "hf")
    randomize(hf)
    spread_routing(hf)
    write_moe_gguf(hf, arch, tmp_path / "tiny.gguf")
    llm = LLM(model=str(tmp_path / "tiny.gguf"), dtype="float32", num_blocks=64)
    tokens = prompt(29)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].log_softmax(-1)
    assert (prefill_logits(llm.engine, tokens).float().log_softmax(-1) - expected).abs().max() <= 1e-4
