"""benchmarks/hybrid.py's bytes per decode token against the models the plugin builds (Qwen3.6-MoE and Qwen3.5
dense at toy sizes, bf16): the weights a decode step reads (the top-k share of the routed experts, one embedding
row), and the recurrent state the engine allocates per sequence."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the scripts import each other
from hybrid import state_bytes, weight_bytes
from shapes import SHAPES

from tests.plugins.qwen.test_qwen3_next import CONFIGS
from tests.plugins.test_moe_decode_bytes import bytes_a_decode_step_reads
from xinfer.cache.allocate import CacheLayout
from xinfer.loading.loader import build_model


@pytest.mark.parametrize("make_config", [SHAPES["qwen3.6-moe-tiny"], CONFIGS["qwen3.5"]], ids=["moe", "dense"])
def test_bytes_match_the_models_parameters_and_state(make_config):
    config = make_config()
    model = build_model(config, torch.device("cpu"), torch.bfloat16)
    assert weight_bytes(config) == bytes_a_decode_step_reads(model, config)
    assert state_bytes(config) == CacheLayout.of(model).slot_bytes(torch.bfloat16)
