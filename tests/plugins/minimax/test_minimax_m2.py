"""MiniMaxM2ForCausalLM against transformers' modeling code (fp32, CPU): q/k RMSNorm over all heads
together, NeoX partial rotary, sigmoid + correction-bias routing renormalized, experts on every
layer. An MTP layer in the checkpoint is skipped; bad input is one clear error."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MiniMaxM2Config

from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_missing_tensor_is_named,
    assert_prefill_logits_match,
    randomize,
    router_outputs,
    spread_routing,
)
from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM


def minimax_m2_config(**overrides) -> MiniMaxM2Config:
    """16 experts, 4 per token, rotary over half of each 32-dim head."""
    settings = dict(
        COMMON,
        intermediate_size=48,
        head_dim=32,
        rotary_dim=16,
        num_local_experts=16,
        num_experts_per_tok=4,
        tie_word_embeddings=False,
        architectures=["MiniMaxM2ForCausalLM"],
    )
    return MiniMaxM2Config(**{**settings, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("minimax-m2")
    hf = save_tiny_model(minimax_m2_config(), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    # an MTP module after the decoder's layers, as MiniMax-M2's config describes (num_mtp_modules)
    tensors = load_file(folder / "model.safetensors")
    mtp = {n.replace("model.layers.1.", "model.layers.2."): t.clone() for n, t in tensors.items() if ".layers.1." in n}
    save_file(mtp, folder / "model-mtp.safetensors")
    return hf, folder


@pytest.fixture(scope="module")
def models(checkpoint):
    hf, folder = checkpoint
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


def test_config_rotates_part_of_each_head(checkpoint):
    hf, _ = checkpoint
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.5


def test_a_config_without_the_rotary_share_rotates_the_checkpoints_rotary_dim():
    """transformers 5.17 and older keep the checkpoints' ``rotary_dim`` as a bare field, out of the rope parameters
    (their own model then turns whole heads); transformers 5.25 reads it as ``partial_rotary_factor``. The model built
    from the fields as the older releases hold them turns the same part of each head."""
    from types import SimpleNamespace

    from xinfer.loading.loader import build_model

    config = minimax_m2_config()
    older = SimpleNamespace(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 5e6}})
    assert "partial_rotary_factor" not in older.rope_parameters and older.rotary_dim == 16
    assert getattr(older, "partial_rotary_factor", None) is None

    def table(config) -> torch.Tensor:
        return build_model(config, torch.device("cpu"), torch.float32).model.layers[0].self_attn.rotary_emb.cos_sin

    assert table(older).shape[-1] == 16  # cos || sin of the 8 pairs of the first 16 dims
    assert torch.equal(table(older), table(config))


def test_routing_spreads_and_the_bias_changes_the_choice(checkpoint):
    hf, _ = checkpoint
    for logits, chosen in router_outputs(hf, prompt(61)):
        assert chosen.unique().numel() >= hf.config.num_local_experts * 3 // 4
        unbiased = logits.sigmoid().topk(hf.config.num_experts_per_tok).indices
        assert (unbiased.sort().values != chosen.sort().values).any(dim=-1).sum() >= 5


@pytest.mark.parametrize("length", (3, 17, 61))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_tokens_and_logprobs_match_hf(models, length):
    assert_greedy_tokens_and_logprobs_match(*models, length)


def test_unknown_routing_function_is_one_clear_error(tmp_path):
    save_tiny_model(minimax_m2_config(scoring_func="sparsemax"), tmp_path)
    with pytest.raises(ValueError, match="scoring_func 'sparsemax' is not a routing function"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


def test_missing_expert_tensor_is_one_clear_error(tmp_path):
    save_tiny_model(minimax_m2_config(), tmp_path)
    assert_missing_tensor_is_named(
        tmp_path, "model.layers.1.block_sparse_moe.experts.5.w3.weight", "model.layers.1.mlp.experts.5.up_proj.weight"
    )
