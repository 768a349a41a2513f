"""Tiny configs of the GLM family for the tests against transformers."""

from transformers import Glm4Config, Glm4MoeConfig, GlmConfig

from tests.tiny_models import COMMON


def dense_settings() -> dict:
    """GLM-4's shape: rotary over half of each 32-dim head, biases on q, k and v (a fresh dict each call:
    configs keep what they are given)."""
    return dict(
        COMMON,
        head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        attention_bias=True,
        tie_word_embeddings=False,
    )


def glm_config(**overrides) -> GlmConfig:
    """GLM-4-9B-hf: Llama's two norms per layer."""
    return GlmConfig(**{**dense_settings(), "architectures": ["GlmForCausalLM"], **overrides})


def glm4_config(**overrides) -> Glm4Config:
    """GLM-4-0414: four norms per layer."""
    return Glm4Config(**{**dense_settings(), "architectures": ["Glm4ForCausalLM"], **overrides})


def glm4_moe_config(**overrides) -> Glm4MoeConfig:
    """A dense first layer, then 16 experts in 4 groups: 4 experts of the 2 best groups, and a shared one."""
    settings = dict(
        COMMON,
        num_hidden_layers=3,
        head_dim=32,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
        attention_bias=True,
        use_qk_norm=True,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
        architectures=["Glm4MoeForCausalLM"],
    )
    return Glm4MoeConfig(**{**settings, **overrides})
