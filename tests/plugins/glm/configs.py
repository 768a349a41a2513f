"""Tiny configs of the GLM family for the tests against transformers."""

from transformers import Glm4Config

from tests.tiny_models import COMMON


def glm4_config(**overrides) -> Glm4Config:
    """Rotary over half of each 32-dim head, biases on q, k and v."""
    settings = dict(
        COMMON,
        head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        attention_bias=True,
        tie_word_embeddings=False,
        architectures=["Glm4ForCausalLM"],
    )
    return Glm4Config(**{**settings, **overrides})
