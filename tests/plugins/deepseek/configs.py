"""Tiny configs of the multi-head latent attention architectures for the tests against transformers."""

from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig

from tests.tiny_models import COMMON

YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128, mscale=1.0,
    mscale_all_dim=0.8, beta_fast=32, beta_slow=1,
)  # fmt: skip


def latent_settings() -> dict:
    """Latent attention's shape in small: 4 heads of 24 + 8 query/key dims and 16 value dims, a 32-value
    latent, a 24-rank q-LoRA; a dense first layer, then 16 experts in 4 groups: 4 experts of the 2 best
    groups, and a shared one."""
    return dict(
        COMMON,
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        attention_bias=False,
        tie_word_embeddings=False,
    )


def deepseek_v3_config(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**{**latent_settings(), "architectures": ["DeepseekV3ForCausalLM"], **overrides})


def glm4_moe_lite_config(**overrides) -> Glm4MoeLiteConfig:
    settings = {k: v for k, v in latent_settings().items() if k != "first_k_dense_replace"}
    return Glm4MoeLiteConfig(**{**settings, "architectures": ["Glm4MoeLiteForCausalLM"], **overrides})


def deepseek_v2_config(**overrides) -> DeepseekV2Config:
    """V2-Lite's shape: no q-LoRA, greedy softmax routing over 16 experts."""
    settings = {k: v for k, v in latent_settings().items() if k not in ("n_group", "topk_group", "norm_topk_prob")}
    settings |= dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)
    return DeepseekV2Config(**{**settings, "architectures": ["DeepseekV2ForCausalLM"], **overrides})
