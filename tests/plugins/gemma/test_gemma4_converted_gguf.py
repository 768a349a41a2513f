"""A tiny GGUF of architecture ``gemma4`` written here as llama.cpp's converter writes one (convert_hf_to_gguf.py's
Gemma4Model: norms as stored, layer scalars named ``.weight``, per-layer head dims, KV heads and MLP widths, the
sliding pattern, the global layers' proportional rope as ``rope_freqs``), through the engine against transformers'
modeling code of the model it came from and against llama.cpp itself.

One model holds every text feature a Gemma 4 file carries: global layers with a head dim and KV
heads of their own and values from the keys, quarter-rotated proportional rope, per-layer inputs, the last two
layers reading earlier layers' caches with MLPs twice as wide, experts beside each dense MLP, a final soft-cap."""

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.converted_gguf import add_tiny_vocabulary
from tests.plugins.gemma.test_gemma4 import E_MODEL, MOE, gemma4_config, randomize_gemma4
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match
from xinfer import LLM
from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf import load_gguf_config

UNROTATED = 1e30  # the converter's divisor of a pair the proportional rope leaves unrotated


def write_gemma4_gguf(
    model: torch.nn.Module, path: Path, sliding_rotated_dims: int | None = None, softcap: bool = True
) -> None:
    """``sliding_rotated_dims``: what the file says the sliding layers rotate (all their head dim unless given)."""
    config = model.config
    layers, kinds = config.num_hidden_layers, config.layer_types
    sliding = [kind == "sliding_attention" for kind in kinds]
    per_layer = [config.per_layer_config[i] for i in range(layers)]
    full, swa = per_layer[kinds.index("full_attention")], per_layer[kinds.index("sliding_attention")]
    shared_from = layers - config.num_kv_shared_layers
    writer = gguf.GGUFWriter(path, "gemma4")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    wide = config.use_double_wide_mlp
    writer.add_feed_forward_length(
        [config.intermediate_size * (2 if wide and i >= shared_from else 1) for i in range(layers)]
        if wide else config.intermediate_size
    )  # fmt: skip
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([layer.num_key_value_heads for layer in per_layer])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(full.head_dim)
    writer.add_value_length(full.head_dim)
    writer.add_key_length_swa(swa.head_dim)
    writer.add_value_length_swa(swa.head_dim)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(full.head_dim)
    writer.add_rope_dimension_count_swa(sliding_rotated_dims or swa.head_dim)
    if softcap:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.top_k_experts)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    add_tiny_vocabulary(writer, config.vocab_size)
    rotated = int(full.head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    divisors = [1.0] * rotated + [UNROTATED] * (full.head_dim // 2 - rotated)
    writer.add_tensor("rope_freqs.weight", torch.tensor(divisors).numpy())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        writer.add_tensor(converted_name(names, hf_name), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def converted_name(names: gguf.TensorNameMap, hf_name: str) -> str:
    """As the converter names it: parameters of their own gain ``.weight``; the router's scale is
    ``ffn_gate_inp.scale``, its per-expert scale ``ffn_down_exps.scale``."""
    module, _, suffix = hf_name.rpartition(".")
    if suffix == "scale" and module.endswith(".router"):
        return f"{names.get_name(module + '.proj')}.scale"
    if suffix == "per_expert_scale":
        return f"{names.get_name(module.removesuffix('.router') + '.experts.down_proj')}.scale"
    if suffix in ("layer_scalar", "gate_up_proj", "down_proj"):
        module, suffix = hf_name, "weight"
    return f"{names.get_name(module)}.{suffix}"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    config = gemma4_config(**{**E_MODEL, **MOE, "attention_k_eq_v": True, "num_global_key_value_heads": 1})
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    randomize_gemma4(hf)
    path = tmp_path_factory.mktemp("gemma4-gguf") / "tiny.gguf"
    write_gemma4_gguf(hf, path)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64), path


@pytest.mark.parametrize("length", (3, 40))  # 40: past the 16-token window
def test_prefill_logits_match_hf(models, length):
    hf, llm, _ = models
    assert_prefill_logits_match(hf, llm, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    hf, llm, _ = models
    assert_greedy_tokens_and_logprobs_match(hf, llm, 17)


def test_llama_cpp_reads_the_gguf_alike(models):
    """To 2e-2, not 1e-4: llama.cpp's CPU GELU is approximate (a table over fp16 inputs), and here it feeds the
    MLPs, the experts and the per-layer input gates (7e-3 measured; with those zeroed the two agree to 7e-6). A
    misread setting is off by far more (measured on this model less its experts: half the global heads rotated
    0.49, the sliding rope base doubled 1.7, the window one shorter 1.7)."""
    _, llm, path = models
    assert_llama_cpp_agrees(llm, path, tolerance=2e-2)


def test_a_partly_rotated_sliding_rope_is_one_error_naming_its_key(models, tmp_path):
    hf, _, _ = models
    path = tmp_path / "half-rotated-sliding.gguf"
    write_gemma4_gguf(hf, path, sliding_rotated_dims=8)
    with pytest.raises(ModelFileError, match=r"half-rotated-sliding\.gguf: gemma4\.rope\.dimension_count_swa = 8"):
        load_gguf_config(path)


def test_a_gguf_without_a_final_softcap_caps_at_llama_cpps_30(models, tmp_path):
    """llama.cpp's Gemma 4 keeps its default cap of 30 where the file writes none (transformers' default: no cap)."""
    hf, _, _ = models
    path = tmp_path / "no-softcap.gguf"
    write_gemma4_gguf(hf, path, softcap=False)
    assert load_gguf_config(path).final_logit_softcapping == 30.0
