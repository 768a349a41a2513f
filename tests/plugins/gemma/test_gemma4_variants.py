"""Gemma 4 on config variants transformers accepts, against its modeling code (fp32, CPU): fields
test_gemma4.py leaves at one value (attention biases, untied embeddings, no logit soft-capping, as many
KV heads on global layers as on sliding ones, a rope scaling factor, the default rope on global layers, the
E-model's sharing with experts, other activations, one no backend fuses)."""

import pytest
from transformers import Gemma4TextModel

from tests.plugins.gemma.test_gemma4 import E_MODEL, LAYER_TYPES, MOE, gemma4_config, randomize_gemma4
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match
from tests.tiny_models import save_tiny_model
from xinfer import LLM
from xinfer_gemma.gemma4 import Gemma4ForCausalLM

SCALED_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.5,
        "rope_theta": 10_000.0,
        "factor": 4.0,
    },
}
PARTIAL_DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25}
VARIANTS = {
    "bias, untied, no softcap, v_proj on global layers": lambda: gemma4_config(
        attention_bias=True, tie_word_embeddings=False, final_logit_softcapping=None, attention_k_eq_v=False,
        num_global_key_value_heads=None,
    ),
    "half-rotary global layers, rope factor 4": lambda: gemma4_config(rope_parameters=SCALED_ROPE),
    # transformers' default rope turns the whole head, whatever partial_rotary_factor says
    "global layers' default rope, partial_rotary_factor ignored": lambda: gemma4_config(
        rope_parameters={**SCALED_ROPE, "full_attention": PARTIAL_DEFAULT_ROPE}
    ),
    # silu: the MLPs' and the per-layer input gate's activation (the gate's ran gelu-tanh)
    "E-model with experts, silu": lambda: gemma4_config(**E_MODEL, **MOE, hidden_activation="silu"),
    # an activation no backend fuses: the experts' act(gate) * up in torch too
    "experts, relu2": lambda: gemma4_config(**MOE, hidden_activation="relu2"),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("variant")
    hf = save_tiny_model(VARIANTS[request.param](), folder)
    randomize_gemma4(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=32)


def test_prefill_logits_match_hf(models):
    assert_prefill_logits_match(*models, 61)


def test_greedy_tokens_and_logprobs_match_hf(models):
    assert_greedy_tokens_and_logprobs_match(*models, 40)


def test_a_model_whose_every_layer_shares_kv_is_one_error():
    # Gemma 4's assistant models read a target model's cache: alone they have none to read
    config = gemma4_config(num_kv_shared_layers=len(LAYER_TYPES))
    with pytest.raises(ValueError, match="reads the KV cache of an earlier sliding_attention layer, and there is none"):
        Gemma4ForCausalLM(config)


def test_experts_enabled_without_their_count_is_one_error():
    config = gemma4_config(enable_moe_block=True)  # num_experts, top_k_experts, moe_intermediate_size unset
    with pytest.raises(TypeError):  # transformers builds experts of no size
        Gemma4TextModel(config)
    with pytest.raises(
        ValueError, match="enable_moe_block True needs num_experts, top_k_experts, moe_intermediate_size"
    ):
        Gemma4ForCausalLM(config)


def test_a_shared_layer_whose_kind_no_earlier_layer_caches_is_one_error_naming_the_field():
    config = gemma4_config(**{**E_MODEL, "num_kv_shared_layers": 4})  # layer 2, the first full layer, shares already
    with pytest.raises(ValueError, match="layer types producing a cache"):  # transformers' own refusal at build
        Gemma4TextModel(config)
    with pytest.raises(ValueError, match=r"layer 2 reads the KV cache .* \(num_kv_shared_layers 4 of layer_types"):
        Gemma4ForCausalLM(config)
