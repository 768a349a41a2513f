"""Multi-token-prediction layers are dropped from a checkpoint's tensors, with one log line:
GLM/DeepSeek/MiniMax number them after the decoder's layers, Qwen stores them under ``mtp.``."""

import logging

import torch

from xinfer.loading.mtp import without_mtp_layers


def names(weights):
    return [name for name, _ in weights]


def test_layers_past_the_last_and_mtp_prefix_are_skipped_with_one_log_line(caplog):
    t = torch.zeros(1)
    weights = [
        ("model.embed_tokens.weight", t),
        ("model.layers.1.mlp.gate.weight", t),
        ("model.layers.2.eh_proj.weight", t),
        ("model.layers.10.self_attn.q_proj.weight", t),
        ("mtp.fc.weight", t),
        ("lm_head.weight", t),
    ]
    with caplog.at_level(logging.INFO):
        kept = names(without_mtp_layers(weights, num_layers=2))
    assert kept == ["model.embed_tokens.weight", "model.layers.1.mlp.gate.weight", "lm_head.weight"]
    assert [r.getMessage() for r in caplog.records] == [
        "skipping the checkpoint's MTP layers (model.layers.2 and on): xinfer does not run them"
    ]


def test_qwen_mtp_prefix_is_named_in_the_log_line(caplog):
    with caplog.at_level(logging.INFO):
        kept = names(without_mtp_layers([("mtp.layers.0.mlp.up.weight", torch.zeros(1))], num_layers=4))
    assert kept == []
    assert "(mtp.*)" in caplog.records[0].getMessage()
