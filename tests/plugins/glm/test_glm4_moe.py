"""Glm4MoeForCausalLM (GLM-4.5/4.6/4.7) against transformers' modeling code (fp32, CPU): a dense first
layer, then sigmoid + correction-bias routing limited to the best groups, renormalized and scaled, with
a shared expert; NeoX partial rotary, q/k norms. The checkpoint's MTP layer is skipped; bad input is one
clear error."""

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.plugins.glm.configs import glm4_moe_config
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_missing_tensor_is_named,
    assert_prefill_logits_match,
    randomize,
    router_outputs,
    spread_routing,
)
from tests.tiny_models import prompt, save_tiny_model
from xinfer import LLM


def save_with_mtp_layer(hf, folder) -> None:
    """The checkpoint as GLM-4.5's: an MTP layer after the decoder's (a decoder layer and its NextN
    projections), which transformers' model does not build."""
    hf.save_pretrained(folder, safe_serialization=True)
    last, mtp = hf.config.num_hidden_layers - 1, hf.config.num_hidden_layers
    tensors = load_file(folder / "model.safetensors")
    extra = {
        name.replace(f"model.layers.{last}.", f"model.layers.{mtp}."): tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith(f"model.layers.{last}.")
    }
    hidden = hf.config.hidden_size
    extra |= {
        f"model.layers.{mtp}.eh_proj.weight": torch.randn(hidden, 2 * hidden),
        f"model.layers.{mtp}.enorm.weight": torch.ones(hidden),
        f"model.layers.{mtp}.hnorm.weight": torch.ones(hidden),
        f"model.layers.{mtp}.shared_head.norm.weight": torch.ones(hidden),
    }
    save_file(extra, folder / "model-mtp.safetensors")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm4-moe")
    hf = save_tiny_model(glm4_moe_config(), folder)
    randomize(hf)
    spread_routing(hf)
    save_with_mtp_layer(hf, folder)
    return hf, folder


@pytest.fixture(scope="module")
def models(checkpoint):
    hf, folder = checkpoint
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


def test_routing_spreads_and_the_group_limit_changes_the_choice(checkpoint):
    hf, _ = checkpoint
    config = hf.config
    biases = [layer.mlp.gate.e_score_correction_bias for layer in hf.model.layers[config.first_k_dense_replace :]]
    for (logits, chosen), bias in zip(router_outputs(hf, prompt(61)), biases, strict=True):
        assert chosen.unique().numel() >= config.n_routed_experts * 3 // 4
        ungrouped = (logits.sigmoid() + bias).topk(config.num_experts_per_tok).indices
        assert (ungrouped.sort().values != chosen.sort().values).any(dim=-1).sum() >= 5


@pytest.mark.parametrize("length", (3, 17, 61))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_tokens_and_logprobs_match_hf(models, length):
    assert_greedy_tokens_and_logprobs_match(*models, length)


def test_mtp_layer_skipped_with_a_log_line(checkpoint, caplog):
    _, folder = checkpoint
    with caplog.at_level(logging.INFO, logger="xinfer.loading.mtp"):
        LLM(model=str(folder), dtype="float32", num_blocks=64)
    assert [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()] == [
        "skipping the checkpoint's MTP layers (model.layers.3 and on): xinfer does not run them"
    ]


def test_unknown_routing_function_is_one_clear_error(tmp_path):
    save_tiny_model(glm4_moe_config(scoring_func="sparsemax"), tmp_path)
    with pytest.raises(ValueError, match="scoring_func 'sparsemax' is not a routing function"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


def test_missing_expert_tensor_is_one_clear_error(tmp_path):
    save_tiny_model(glm4_moe_config(), tmp_path)
    assert_missing_tensor_is_named(
        tmp_path, "model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.2.mlp.experts.5.up_proj.weight"
    )
