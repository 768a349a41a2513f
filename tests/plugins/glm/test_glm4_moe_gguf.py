"""A GGUF of architecture ``glm4moe`` written here as llama.cpp's converter writes one (experts stacked, the
MTP layer kept and counted in ``block_count``, q/k biases and norms only as tensors), through the engine
against transformers' modeling code of the model it came from."""

import gguf
import pytest

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.converted_gguf import checkpoint_tensors, write_converted_gguf
from tests.plugins.glm.configs import glm4_moe_config
from tests.plugins.glm.test_glm4_moe import save_with_mtp_layer
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    randomize,
    spread_routing,
)
from tests.tiny_models import save_tiny_model
from xinfer import LLM
from xinfer.loading.gguf import load_gguf_config


def write_glm4_moe_gguf(
    folder, config, path, left_out: tuple[str, ...] = (), gating=gguf.ExpertGatingFuncType.SIGMOID
) -> None:
    """``left_out``: keys the converter writes only where the checkpoint's config has the field (llama.cpp then
    reads no dense layers, weights not renormalized, sigmoid gating)."""
    mtp_layers = config.num_nextn_predict_layers

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        optional = {
            "leading_dense_block_count": lambda: writer.add_leading_dense_block_count(config.first_k_dense_replace),
            "expert_gating_func": lambda: writer.add_expert_gating_func(gating),
            "expert_weights_norm": lambda: writer.add_expert_weights_norm(config.norm_topk_prob),
        }
        for key, write in optional.items():
            if key not in left_out:
                write()
        writer.add_expert_weights_scale(config.routed_scaling_factor)
        writer.add_nextn_predict_layers(mtp_layers)

    block_count = config.num_hidden_layers + mtp_layers
    write_converted_gguf(path, "glm4moe", config, checkpoint_tensors(folder), block_count, metadata)


# llama.cpp's glm4moe routes without groups: the converter writes no n_group / topk_group
CASES = {
    "biases-and-qk-norms": (dict(n_group=1, topk_group=1), ()),
    "neither": (dict(n_group=1, topk_group=1, attention_bias=False, use_qk_norm=False, norm_topk_prob=False), ()),
    "optional-keys-left-out": (
        dict(n_group=1, topk_group=1, first_k_dense_replace=0, norm_topk_prob=False),
        ("leading_dense_block_count", "expert_gating_func", "expert_weights_norm"),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"glm4-moe-gguf-{request.param}")
    overrides, left_out = CASES[request.param]
    hf = save_tiny_model(glm4_moe_config(**overrides), folder)
    randomize(hf)
    spread_routing(hf)
    save_with_mtp_layer(hf, folder)
    path = folder / "tiny.gguf"
    write_glm4_moe_gguf(folder, hf.config, path, left_out)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64), path


def test_config_reads_the_layers_biases_and_routing(models):
    hf, _, path = models
    config = load_gguf_config(path)
    assert config.architectures == ["Glm4MoeForCausalLM"]
    for field in ("num_hidden_layers", "attention_bias", "use_qk_norm", "first_k_dense_replace", "n_routed_experts",
                  "n_shared_experts", "moe_intermediate_size", "routed_scaling_factor", "norm_topk_prob"):  # fmt: skip
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


def test_softmax_gating_is_one_clear_error(tmp_path):
    hf = save_tiny_model(glm4_moe_config(n_group=1, topk_group=1), tmp_path)
    write_glm4_moe_gguf(tmp_path, hf.config, tmp_path / "tiny.gguf", gating=gguf.ExpertGatingFuncType.SOFTMAX)
    with pytest.raises(ValueError, match=r"tiny\.gguf: glm4moe\.expert_gating_func: softmax gating is not GLM-4\.5's"):
        load_gguf_config(tmp_path / "tiny.gguf")
