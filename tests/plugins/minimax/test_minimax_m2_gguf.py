"""A GGUF of architecture ``minimax-m2`` written here as llama.cpp's converter writes one (experts stacked,
the correction bias as ``exp_probs_b.bias``, the rotated share of a head as ``rope.dimension_count``),
through the engine against transformers' modeling code of the model it came from."""

import gguf
import pytest

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.converted_gguf import checkpoint_tensors, write_converted_gguf
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    randomize,
    spread_routing,
)
from tests.plugins.minimax.test_minimax_m2 import minimax_m2_config
from tests.tiny_models import save_tiny_model
from xinfer import LLM
from xinfer.loading.gguf import load_gguf_config


def metadata_writer(config):
    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))

    return metadata


def write_minimax_m2_gguf(folder, config, path) -> None:
    tensors = checkpoint_tensors(folder)
    write_converted_gguf(path, "minimax-m2", config, tensors, config.num_hidden_layers, metadata_writer(config))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("minimax-m2-gguf")
    hf = save_tiny_model(minimax_m2_config(), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    path = folder / "tiny.gguf"
    write_minimax_m2_gguf(folder, hf.config, path)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64), path


def test_config_reads_the_experts_and_the_rotated_share(models):
    hf, _, path = models
    config = load_gguf_config(path)
    assert config.architectures == ["MiniMaxM2ForCausalLM"]
    for field in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "head_dim"):
        assert getattr(config, field) == getattr(hf.config, field), field
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


def test_an_unknown_gating_function_is_one_error_naming_the_key():
    from xinfer_minimax.gguf import MiniMaxM2GGUF

    metadata = {"minimax-m2.expert_count": 8, "minimax-m2.expert_used_count": 2, "minimax-m2.expert_gating_func": 7}
    fields = {"hidden_size": 64, "num_attention_heads": 4}
    with pytest.raises(ValueError, match=r"minimax-m2\.expert_gating_func = 7 .*sigmoid"):
        MiniMaxM2GGUF().config(metadata, fields, [])
