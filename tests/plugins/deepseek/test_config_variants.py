"""The latent-attention architectures on config variants transformers accepts, each against transformers'
modeling code (fp32, CPU): prefill logits and greedy tokens. Every variant flips fields test_deepseek.py
leaves at one value (the query path, rotary layout and scaling, biases, head sizes, dense and sparse layer
layouts, routing options, the experts' activation), or is another architecture: GLM-4.7-Flash, DeepSeek-V2(-Lite), V3.2, V4."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from transformers import PretrainedConfig

from tests.plugins.deepseek.configs import YARN, deepseek_v2_config, deepseek_v3_config, glm4_moe_lite_config
from tests.plugins.deepseek.test_deepseek_v4 import deepseek_v4_config
from tests.plugins.deepseek.test_deepseek_v32 import deepseek_v32_config
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    randomized_model,
)
from tests.tiny_models import save_tiny_model
from xinfer import LLM

CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "v3 no q-lora, yarn with mscale, NeoX rotary, biases": lambda: deepseek_v3_config(
        q_lora_rank=None, rope_parameters=YARN, rope_interleave=False, attention_bias=True
    ),
    # a latent rank with no fp8 row (not a multiple of 4): the default format caches it as it is
    "v3 kv_lora_rank 30": lambda: deepseek_v3_config(kv_lora_rank=30),
    "v3 2 dense of 3, one group, raw weights unscaled, v_head_dim 32, 2 shared": lambda: deepseek_v3_config(
        first_k_dense_replace=2, n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0,
        v_head_dim=32, n_shared_experts=2,
    ),
    # rms_norm_eps far from the 1e-6 the latents' norms keep, as transformers' (GLM-4.7-Flash's is 1e-5)
    "glm-4.7-flash all sparse, 8 groups of 2, top-3, yarn, eps 1e-3": lambda: glm4_moe_lite_config(
        mlp_layer_types=["sparse"] * 3, n_group=8, topk_group=3, rope_parameters=YARN, rms_norm_eps=1e-3
    ),
    "v2-lite: no q-lora, greedy softmax routing, yarn, mlp biases": lambda: deepseek_v2_config(
        rope_parameters=YARN, mlp_bias=True
    ),
    # V3.2's config declares mlp_bias, which transformers' V3.2 (as its V3 and GLM-4.7-Flash) ignores
    "v3.2 mlp_bias set": lambda: deepseek_v32_config(mlp_bias=True),
    "v4 mlp_bias: the shared experts' biases": lambda: deepseek_v4_config(mlp_bias=True),
    # transformers' V4 router scores by any ACT2FN name: tanh's negative scores renormalized, hashed layer too
    "v4 tanh scores": lambda: deepseek_v4_config(scoring_func="tanh"),
    # transformers' own default table spans qk_rope_head_dim, whatever partial_rotary_factor says
    "v3 default rope, partial_rotary_factor 0.5 ignored": lambda: deepseek_v3_config(
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
    ),
    # the default rope scales nothing, factor and mscale_all_dim or not (the softmax scale only under another type);
    # relu experts: an activation no backend fuses
    "v2 default rope with factor 4 and mscale_all_dim, partial 0.5, relu": lambda: deepseek_v2_config(
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                             partial_rotary_factor=0.5),
        hidden_act="relu",
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory):
    return randomized_model(CONFIGS[request.param](), tmp_path_factory.mktemp("variant"))


@pytest.mark.parametrize("length", (5, 29))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    assert_greedy_tokens_and_logprobs_match(*models, 13)


ERRORS: dict[str, tuple[Callable[[], PretrainedConfig], str]] = {
    "v2 group-limited routing": (
        lambda: deepseek_v2_config(topk_method="group_limited_greedy", n_group=4, topk_group=2),
        "topk_method 'group_limited_greedy' is not supported",
    ),
    # transformers builds the shared expert 0 wide, its down_proj bias still added
    "v2 no shared expert with mlp biases": (
        lambda: deepseek_v2_config(n_shared_experts=0, mlp_bias=True),
        "n_shared_experts 0 with mlp_bias True is not supported",
    ),
    # transformers' scaled table has one frequency for the two rope pairs, broadcast over both
    "v2 partial rotary with yarn": (
        lambda: deepseek_v2_config(qk_rope_head_dim=4, rope_parameters={**YARN, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor 0.5 is not supported",
    ),
    # transformers' GLM-4.7-Flash sizes even its default table by the factor: a shape error
    "glm-4.7-flash partial rotary with the default rope": (
        lambda: glm4_moe_lite_config(
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)
        ),
        "partial_rotary_factor 0.5 is not supported with rope_type 'default'",
    ),
    # transformers rotates the indexer's heads by the attention's rope dims (16 of 32 here): a shape error
    "v4 indexer heads narrower than the rotated dims": (
        lambda: deepseek_v4_config(index_head_dim=8, partial_rotary_factor=0.5),
        "index_head_dim 8 is smaller than the 16 rotated dims",
    ),
    "v3 experts not in groups": (
        lambda: deepseek_v3_config(n_group=3),
        "n_group 3 and topk_group 2 do not fit 16 experts",
    ),
    # transformers repeats the per-head keys and values again by num_attention_heads // num_key_value_heads:
    # a shape error (every latent-attention checkpoint has as many of one as of the other)
    "v3 fewer kv heads than heads": (
        lambda: deepseek_v3_config(num_key_value_heads=2),
        "num_key_value_heads 2 differs from num_attention_heads 4",
    ),
    # transformers rotates each call by the short or long factors as the largest position it rotates says (the
    # step's, the compressed entries'): served, but as no paged step does
    "v4 longrope": (
        lambda: deepseek_v4_config(
            rope_parameters=dict(
                rope_type="longrope",
                original_max_position_embeddings=16,
                short_factor=[1.0, 1.1, 1.3, 1.6],
                long_factor=[1.5, 3.0, 7.0, 15.0],
            )
        ),
        "rope_type 'longrope' is not supported by DeepSeek-V4's rotary",
    ),
    "glm-4.7-flash more heads than kv heads": (
        lambda: glm4_moe_lite_config(num_attention_heads=8),
        "num_key_value_heads 4 differs from num_attention_heads 8",
    ),
    # transformers scores a group by its best two experts: an index out of range
    "v3 groups of one expert": (
        lambda: deepseek_v3_config(n_group=16, topk_group=1, num_experts_per_tok=1),
        "n_group 16 leaves one of the 16 experts a group",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_unsupported_value_is_one_error_naming_the_field(name, tmp_path):
    config, message = ERRORS[name]
    save_tiny_model(config(), tmp_path)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)
