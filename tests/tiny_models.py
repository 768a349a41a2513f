"""Tiny random HF models saved as safetensors folders: the reference for every
architecture test. transformers' modeling code is the oracle; nothing here is ours."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Phi3Config, PretrainedConfig

from xinfer import ops
from xinfer.engine.engine import LLMEngine

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def gemma3_config(**overrides) -> Gemma3TextConfig:
    """Gemma 3 with sliding (16-token) and full layers, each kind with its own rope."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    settings = dict(
        COMMON,
        num_hidden_layers=len(layer_types),
        head_dim=32,
        layer_types=layer_types,
        sliding_window=16,
        query_pre_attn_scalar=24,  # differs from head_dim, so the scale is checked
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        tie_word_embeddings=True,
        architectures=["Gemma3ForCausalLM"],
    )
    return Gemma3TextConfig(**{**settings, **overrides})


def phi3_longrope_config(**overrides) -> Phi3Config:
    """Phi-3.5-style LongRoPE trained at 32 positions (so prompts start short or long, and generations cross
    over), half the head rotated."""
    settings = dict(
        COMMON,
        num_key_value_heads=4,
        original_max_position_embeddings=32,
        rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.5,
            short_factor=[1.0, 1.3, 1.9, 2.2], long_factor=[1.5, 4.0, 9.0, 21.0],
        ),
        tie_word_embeddings=False,
        architectures=["Phi3ForCausalLM"],
    )  # fmt: skip
    return Phi3Config(**{**settings, **overrides})


def save_tiny_model(config: PretrainedConfig, folder: Path, seed: int = 0):
    """Random HF model of ``config`` (fp32, eager attention) saved to ``folder``; returns it."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def prompt(length: int, vocab_size: int = COMMON["vocab_size"], seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1000 + length)
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


def prefill_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``token_ids``, computed through the paged KV cache."""
    hidden = engine.hidden_states(token_ids)
    with torch.inference_mode(), ops.use(engine.ops):
        return engine.model.compute_logits(hidden)
