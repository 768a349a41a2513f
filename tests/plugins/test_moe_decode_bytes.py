"""benchmarks/moe.py's bytes per decode token: against a hand computation at GLM-4.5-Air's shape, and against
the parameters of the models the plugins build (GLM-4.5 and Qwen3 MoE at toy sizes, bf16 with GLM's fp32
router), read as a decode step reads them: the top-k share of the routed experts, one embedding row."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import PretrainedConfig, Qwen3MoeConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as the scripts import each other
from moe import decode_bytes_per_token
from shapes import SHAPES

from tests.tiny_models import COMMON
from xinfer.loading.loader import build_model


def test_glm_4_5_air_matches_a_hand_count():
    config = SHAPES["glm-4.5-air"]()
    attention = 2 * (4096 * 128 * (2 * 96 + 2 * 8) + 128 * (96 + 2 * 8) + 2 * 4096)  # + qkv biases, two norms
    dense_mlp = 2 * 3 * 4096 * 10944
    moe_mlp = 2 * (8 + 1) * 3 * 4096 * 1408 + 4 * (128 * 4096 + 128)  # 8 routed + 1 shared; the fp32 router
    ends = 2 * (4096 + 4096 + 151552 * 4096)
    weights = 23 * attention + dense_mlp + 22 * moe_mlp + ends
    assert weights == 13_425_458_176  # the figure moe.py's docstring shows
    assert decode_bytes_per_token(config, 0) == weights
    assert decode_bytes_per_token(config, 1000) == weights + 1000 * 23 * 2 * 8 * 128 * 2


def qwen3_moe_tiny() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=16, num_experts_per_tok=4,
                          moe_intermediate_size=32, tie_word_embeddings=False,
                          architectures=["Qwen3MoeForCausalLM"])  # fmt: skip


def bytes_a_decode_step_reads(model: torch.nn.Module, config: PretrainedConfig) -> int:
    total = 0
    for name, param in model.named_parameters():
        if param.dim() == 3:  # routed experts [E, ...]: a token's top-k of them
            total += param.nbytes * config.num_experts_per_tok // param.shape[0]
        elif name.endswith("embed_tokens.weight"):
            total += param[0].nbytes
        else:
            total += param.nbytes
    return total


@pytest.mark.parametrize("make_config", [SHAPES["glm4-moe-tiny"], qwen3_moe_tiny], ids=["glm4-moe", "qwen3-moe"])
def test_weights_match_the_models_parameters(make_config):
    config = make_config()
    model = build_model(config, torch.device("cpu"), torch.bfloat16)
    assert decode_bytes_per_token(config, 0) == bytes_a_decode_step_reads(model, config)
