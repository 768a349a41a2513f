"""A tiny GGUF of architecture ``gemma3`` written here as llama.cpp's converter writes one (every norm weight
stored as ``1 + w``, no output matrix: tied, the global layers' rope base and linear scaling only, the window), through the engine
against transformers' modeling code of the model it came from and against llama.cpp itself.

What the file leaves out is what llama.cpp hard-codes, so the tiny model keeps to it: one global layer in six,
the sliding layers' rope base 10k, queries scaled by head_dim."""

from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.converted_gguf import add_tiny_vocabulary
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match, randomize
from tests.tiny_models import gemma3_config
from xinfer import LLM


def write_gemma3_gguf(model: torch.nn.Module, path: Path) -> None:
    config = model.config
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    full_rope = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(full_rope["rope_theta"])
    if full_rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full_rope["factor"])
    if "sliding_attention" in config.layer_types:
        writer.add_sliding_window(config.sliding_window)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    add_tiny_vocabulary(writer, config.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        values = tensor + 1 if hf_name.endswith("norm.weight") else tensor
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", values.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    rope = {  # Gemma 3 4B and larger: the global layers' rope linearly scaled
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    }
    config = gemma3_config(num_hidden_layers=6, layer_types=layer_types, query_pre_attn_scalar=32, rope_parameters=rope)
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    randomize(hf)
    path = tmp_path_factory.mktemp("gemma3-gguf") / "tiny.gguf"
    write_gemma3_gguf(hf, path)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64), path


@pytest.mark.parametrize("length", (3, 40))  # 40: past the 16-token window
def test_prefill_logits_match_hf(models, length):
    hf, llm, _ = models
    assert_prefill_logits_match(hf, llm, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    hf, llm, _ = models
    assert_greedy_tokens_and_logprobs_match(hf, llm, 17)


def test_llama_cpp_reads_the_gguf_alike(models):
    """To 5e-3, not 1e-4: llama.cpp's CPU GELU is approximate (a table over fp16 inputs; with the MLPs zeroed the
    two agree to 5e-6). A misread tensor or setting (the norms' 1 + w, a rope base, the window, the query scale,
    gate and up swapped) is off by far more."""
    _, llm, path = models
    assert_llama_cpp_agrees(llm, path, tolerance=5e-3)


def test_a_gguf_without_a_window_runs_every_layer_global_as_llama_cpp(tmp_path):
    """No ``sliding_window`` written (or 0): llama.cpp slides no layer, where its period of six would."""
    torch.manual_seed(0)
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}  # fmt: skip
    config = gemma3_config(num_hidden_layers=6, layer_types=["full_attention"] * 6, query_pre_attn_scalar=32,
                           rope_parameters=rope)  # fmt: skip
    hf = AutoModelForCausalLM.from_config(config).float().eval()
    randomize(hf)
    path = tmp_path / "tiny.gguf"
    write_gemma3_gguf(hf, path)
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    assert_prefill_logits_match(hf, llm, 40)
    assert_llama_cpp_agrees(llm, path, tolerance=5e-3)
