"""A GGUF of architecture ``glm4`` written here as llama.cpp's converter writes one (the
checkpoint's tensors unchanged, the rotated share of a head as ``rope.dimension_count``),
through the engine against transformers' modeling code of the model it came from."""

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.converted_gguf import add_tiny_vocabulary
from tests.plugins.glm.configs import glm4_config
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match, randomize
from xinfer import LLM
from xinfer.loading.gguf import load_gguf_config


def write_glm4_gguf(model: torch.nn.Module, path: Path, mtp: bool = False, per_layer: bool = False) -> None:
    """``mtp``: an MTP layer after the decoder's (GLM-OCR's: a layer and its NextN projections), which
    ``block_count`` counts; ``per_layer``: the head counts and feed-forward length one per layer, as llama.cpp
    also reads them."""
    config = model.config
    rope = config.rope_parameters
    layers = config.num_hidden_layers
    blocks = layers + mtp

    def each(value: int) -> int | list[int]:
        return [value] * blocks if per_layer else value

    writer = gguf.GGUFWriter(path, "glm4")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(blocks)
    writer.add_feed_forward_length(each(config.intermediate_size))
    writer.add_head_count(each(config.num_attention_heads))
    writer.add_head_count_kv(each(config.num_key_value_heads))
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(config.head_dim * rope["partial_rotary_factor"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_tiny_vocabulary(writer, config.vocab_size, pre="glm4")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4, blocks)
    tensors = model.state_dict()
    if mtp:
        writer.add_nextn_predict_layers(1)
        last = f"model.layers.{layers - 1}."
        tensors |= {n.replace(last, f"model.layers.{layers}."): t for n, t in tensors.items() if n.startswith(last)}
        hidden = config.hidden_size
        writer.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", torch.randn(hidden, 2 * hidden).numpy())
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            writer.add_tensor(f"blk.{layers}.nextn.{norm}.weight", torch.ones(hidden).numpy())
    for hf_name, tensor in tensors.items():
        base, _, suffix = hf_name.rpartition(".")
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    config = glm4_config(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))
    config._attn_implementation = "eager"
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    randomize(hf)
    path = tmp_path_factory.mktemp("glm4-gguf") / "tiny.gguf"
    write_glm4_gguf(hf, path)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64), path


def test_config_reads_the_rotated_share(models):
    hf, _, path = models
    config = load_gguf_config(path)
    assert config.architectures == ["Glm4ForCausalLM"]
    assert config.rope_parameters["partial_rotary_factor"] == hf.config.rope_parameters["partial_rotary_factor"]


@pytest.mark.parametrize("length", (3, 61))
def test_prefill_logits_match_hf(models, length):
    hf, llm, _ = models
    assert_prefill_logits_match(hf, llm, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    hf, llm, _ = models
    assert_greedy_tokens_and_logprobs_match(hf, llm, 17)


def test_llama_cpp_reads_the_gguf_alike(models):
    _, llm, path = models
    assert_llama_cpp_agrees(llm, path)


def test_a_gguf_without_attention_biases_runs_like_llama_cpp(tmp_path):
    """GLM-4's q, k and v biases are optional (``attention_bias``; transformers' default: present): a file
    without them says so only by their absence, and llama.cpp runs it without."""
    torch.manual_seed(0)
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    hf = AutoModelForCausalLM.from_config(glm4_config(attention_bias=False, rope_parameters=rope)).float().eval()
    randomize(hf)
    path = tmp_path / "tiny.gguf"
    write_glm4_gguf(hf, path)
    assert not load_gguf_config(path).attention_bias
    assert_llama_cpp_agrees(LLM(model=str(path), dtype="float32", num_blocks=64), path)


def test_an_mtp_layer_and_per_layer_sizes_read_as_llama_cpp_reads_them(tmp_path):
    """GLM-OCR's file keeps an MTP layer that ``block_count`` counts (``nextn_predict_layers``): skipped; head
    counts and the feed-forward length written one per layer, all alike: read as one value each."""
    torch.manual_seed(0)
    rope = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    hf = AutoModelForCausalLM.from_config(glm4_config(rope_parameters=rope)).float().eval()
    randomize(hf)
    path = tmp_path / "tiny.gguf"
    write_glm4_gguf(hf, path, mtp=True, per_layer=True)
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    assert_prefill_logits_match(hf, llm, 29)
    assert_llama_cpp_agrees(llm, path)
