"""benchmarks/deepseek_v4.py's bytes per decode token against the parameters of the model the plugin builds
(V4 at toy sizes, bf16), read as a decode step reads them: the top-k share of the routed experts, one
embedding row and one row of a hash router's table; and the cache's bytes per token from the layers' specs."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))  # as the scripts import each other
from deepseek_v4 import cache_bytes_per_token, decode_bytes_per_token
from shapes import SHAPES

from tests.plugins.test_moe_decode_bytes import bytes_a_decode_step_reads
from xinfer.loading.loader import build_model


def test_weights_match_the_models_parameters():
    config = SHAPES["deepseek-v4-tiny"]()
    model = build_model(config, torch.device("cpu"), torch.bfloat16)
    tables = sum(p.nbytes - p[0].nbytes for name, p in model.named_parameters() if name.endswith("tid2eid"))
    assert decode_bytes_per_token(config, 0) == bytes_a_decode_step_reads(model, config) - tables


def test_cache_bytes_per_token_from_the_specs():
    """The tiny shape at 256 tokens, blocks of 16: per CSA layer 64 entries of 32 + 16 values, per HCA layer
    16 entries of 32 (one block's row each), all layers' windows (8: two blocks; 16: two blocks), in fp32."""
    config = SHAPES["deepseek-v4-tiny"]()
    entries = 2 * 64 * (32 + 16) + 16 * 32  # two CSA layers, one HCA
    window_8 = 2 * 16 * (4 * 32 + 2 * (4 * 32 + 4 * 16))  # 4 layers' rows; 2 CSA layers' open windows (+ indexer)
    window_16 = 2 * 16 * 2 * 32  # the HCA layer's open windows
    assert cache_bytes_per_token(config, 256, 16, 4) == 4 * (entries + window_8 + window_16) / 256
