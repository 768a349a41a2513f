"""The MoE, GLM and Phi-4-mini architectures on config variants transformers accepts, each against transformers'
modeling code (fp32, CPU): prefill logits and greedy tokens. Every variant flips fields the architecture's
own test leaves at one value (bias switches, shared experts off or doubled, dense and sparse layer
layouts, routing options, head sizes, partial rotary, sliding windows, rope scaling (YaRN's factor left out,
LongRoPE), tied embeddings, activations, the experts' too). Below them, values transformers accepts that xinfer refuses (any architecture): each one
error at load naming the field and the value."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Glm4Config,
    Glm4MoeConfig,
    GlmConfig,
    LlamaConfig,
    MiniMaxM2Config,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from tests.plugins.gemma.test_gemma4 import E_MODEL, gemma4_config
from tests.plugins.gemma.test_gemma4_variants import SCALED_ROPE
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    hf_greedy,
    randomize,
    randomized_model,
)
from tests.plugins.qwen.test_qwen3_next import HYBRID
from tests.tiny_models import COMMON, gemma3_config, phi3_longrope_config, prompt, save_tiny_model
from xinfer import LLM

SMALL = dict(COMMON, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
QWEN_MOE = dict(SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, tie_word_embeddings=False)
GLM = dict(SMALL, head_dim=16, attention_bias=True, tie_word_embeddings=False)
GLM_MOE = dict(
    SMALL, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
    moe_intermediate_size=16, first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True,
    use_qk_norm=True, tie_word_embeddings=False, architectures=["Glm4MoeForCausalLM"],
)  # fmt: skip
MINIMAX = dict(
    SMALL, intermediate_size=16, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
    tie_word_embeddings=False, architectures=["MiniMaxM2ForCausalLM"],
)  # fmt: skip
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128)
LONGROPE = dict(
    rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16, short_factor=[1.0, 1.1, 1.3, 1.6],
    long_factor=[1.5, 3.0, 7.0, 15.0],
)  # fmt: skip
LINEAR = dict(rope_type="linear", rope_theta=10000.0, factor=2.0)
DEFAULT_ROPE = dict(rope_type="default", rope_theta=10000.0)
LLAMA3 = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=64,
)  # fmt: skip


def qwen2_moe(**overrides) -> Qwen2MoeConfig:
    return Qwen2MoeConfig(**{**QWEN_MOE, "architectures": ["Qwen2MoeForCausalLM"], **overrides})


def qwen3_moe(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**QWEN_MOE, "architectures": ["Qwen3MoeForCausalLM"], **overrides})


def glm(**overrides) -> GlmConfig:
    return GlmConfig(**{**GLM, "architectures": ["GlmForCausalLM"], **overrides})


def glm4(**overrides) -> Glm4Config:
    return Glm4Config(**{**GLM, "architectures": ["Glm4ForCausalLM"], **overrides})


CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen2-moe no shared expert": lambda: qwen2_moe(shared_expert_intermediate_size=0),
    "qwen2-moe no qkv bias, renormalized, tied, exact gelu": lambda: qwen2_moe(
        shared_expert_intermediate_size=24, qkv_bias=False, norm_topk_prob=True, tie_word_embeddings=True,
        hidden_act="gelu",
    ),
    "qwen2-moe sparse step 2, mlp-only layer 3 of 4": lambda: qwen2_moe(
        num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3], shared_expert_intermediate_size=24
    ),
    "qwen2-moe sliding window below max_window_layers": lambda: qwen2_moe(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=8, max_window_layers=2,
        shared_expert_intermediate_size=24,
    ),
    "qwen2-moe yarn": lambda: qwen2_moe(shared_expert_intermediate_size=24, rope_parameters=YARN),
    # activations no backend fuses, in the experts too (the reference fused_moe's torch act(gate) * up)
    "qwen2-moe relu": lambda: qwen2_moe(shared_expert_intermediate_size=24, hidden_act="relu"),
    "qwen3-moe attention bias, head_dim 8, top-1": lambda: qwen3_moe(
        attention_bias=True, head_dim=8, num_experts_per_tok=1, norm_topk_prob=False
    ),
    "qwen3-moe sliding window, sparse step 2": lambda: qwen3_moe(
        use_sliding_window=True, sliding_window=8, decoder_sparse_step=2, norm_topk_prob=True
    ),
    "qwen3-moe llama3 rope, tied": lambda: qwen3_moe(rope_parameters=LLAMA3, tie_word_embeddings=True),
    # the factor left out: max_position_embeddings / original_max_position_embeddings, as transformers reads it
    "qwen3-moe yarn, factor null": lambda: qwen3_moe(rope_parameters={**YARN, "factor": None}),
    # trained at 16 positions, crossed while generating: the keys cached before stay (only Phi-3 recomputes them)
    "qwen3-moe longrope": lambda: qwen3_moe(rope_parameters=LONGROPE),
    "glm no bias, full rotary, tied": lambda: glm(
        attention_bias=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
        tie_word_embeddings=True,
    ),
    "glm head_dim 32, 4 kv heads": lambda: glm(head_dim=32, num_key_value_heads=4),
    "glm relu": lambda: glm(hidden_act="relu"),
    # activations no backend fuses: act(gate) * up in torch
    "glm relu2": lambda: glm(hidden_act="relu2"),
    "glm quick_gelu": lambda: glm(hidden_act="quick_gelu"),
    "glm4 no bias, full rotary, tied": lambda: glm4(
        attention_bias=False, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
        tie_word_embeddings=True,
    ),
    "glm4 no rotary (partial_rotary_factor 0)": lambda: glm4(rope_parameters={**DEFAULT_ROPE, "partial_rotary_factor": 0.0}),
    "glm4 head_dim 32, linear rope": lambda: glm4(
        head_dim=32,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.5),
    ),
    "glm4-moe all sparse, no shared expert, raw weights": lambda: Glm4MoeConfig(
        **{**GLM_MOE, "first_k_dense_replace": 0, "n_shared_experts": 0, "norm_topk_prob": False}
    ),
    "glm4-moe 2 dense of 3, 2 shared, one group, no qk norm, no bias": lambda: Glm4MoeConfig(
        **{**GLM_MOE, "num_hidden_layers": 3, "first_k_dense_replace": 2, "n_shared_experts": 2, "n_group": 1,
           "topk_group": 1, "use_qk_norm": False, "attention_bias": False}
    ),
    "glm4-moe relu2, first layer dense": lambda: Glm4MoeConfig(**{**GLM_MOE, "hidden_act": "relu2"}),
    "glm4-moe head_dim 8, full rotary, unscaled, tied": lambda: Glm4MoeConfig(
        **{**GLM_MOE, "head_dim": 8, "routed_scaling_factor": 1.0, "tie_word_embeddings": True,
           "rope_parameters": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0)}
    ),
    # Phi-4-mini's shape: 3/4 of each head rotated, LongRoPE (crossed while generating: recomputed), tied
    "phi-4-mini: partial longrope, tied": lambda: phi3_longrope_config(
        num_attention_heads=2, num_key_value_heads=1, original_max_position_embeddings=16, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.75,
                             short_factor=[1.0 + 0.1 * i for i in range(12)], long_factor=[1.5 + i for i in range(12)]),
    ),
    # transformers reads YaRN's truncate from the top of a per-layer-type rope dict, so truncates whatever it says
    "gemma3 yarn truncate false on global layers": lambda: gemma3_config(
        rope_parameters={"full_attention": {**YARN, "factor": 8.0, "original_max_position_embeddings": 32,
                                            "truncate": False},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    ),
    "minimax-m2 full rotary, top-1": lambda: MiniMaxM2Config(**{**MINIMAX, "rotary_dim": 16, "num_experts_per_tok": 1}),
    "minimax-m2 head_dim 8, 16 experts, tied": lambda: MiniMaxM2Config(
        **{**MINIMAX, "head_dim": 8, "rotary_dim": 4, "num_local_experts": 16, "num_experts_per_tok": 4,
           "tie_word_embeddings": True}
    ),
    # sweepa (each field alone against transformers):
    # rotary_dim null: transformers sets no partial factor, so rotates whole heads
    "minimax-m2 rotary_dim null": lambda: MiniMaxM2Config(**{**MINIMAX, "rotary_dim": None}),
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
    "glm4-moe experts not in groups": (
        lambda: Glm4MoeConfig(**{**GLM_MOE, "n_group": 3}),
        "n_group 3 and topk_group 2 do not fit 16 experts",
    ),
    "glm4-moe softmax scores": (
        lambda: Glm4MoeConfig(**{**GLM_MOE, "scoring_func": "softmax"}),
        "scoring_func 'softmax' is not supported",
    ),
    "minimax-m2 softmax scores": (
        lambda: MiniMaxM2Config(**{**MINIMAX, "scoring_func": "softmax"}),
        "scoring_func 'softmax' is not supported",
    ),
    # transformers rotates whole heads with a table sized by the factor: a shape error
    "gemma4 linear rope with partial rotary": (
        lambda: gemma4_config(
            rope_parameters={**SCALED_ROPE, "full_attention": {**LINEAR, "partial_rotary_factor": 0.5}}
        ),
        r"partial_rotary_factor 0.5 with rope_type 'linear' \(full_attention\) is not supported",
    ),
    # transformers' per-layer embedding fails on the tokens past its table (and xinfer's would end the engine)
    "gemma4 per-layer vocabulary smaller than the vocabulary": (
        lambda: gemma4_config(**{**E_MODEL, "vocab_size_per_layer_input": 128}),
        "vocab_size_per_layer_input 128 is smaller than vocab_size 320",
    ),
    # transformers repeats each key head over linear_num_value_heads // linear_num_key_heads value heads: a shape error
    "qwen3.5 value heads not a multiple of the key heads": (
        lambda: Qwen3_5TextConfig(**{**HYBRID, "linear_num_value_heads": 3}, architectures=["Qwen3_5ForCausalLM"]),
        "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2",
    ),
    # transformers' top-k over the experts fails (an index out of range)
    "qwen3-moe more experts a token than experts": (
        lambda: qwen3_moe(num_experts_per_tok=9),
        "num_experts_per_tok 9 is more than the 8 experts",
    ),
    # transformers' Llama sizes the scaled table by the factor, then rotates whole heads with it: a shape error
    "qwen3-moe yarn with partial rotary": (
        lambda: qwen3_moe(rope_parameters={**YARN, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor 0.5 with rope_type 'yarn' is not supported: Qwen3MoeForCausalLM rotates whole heads",
    ),
    "gemma4 bidirectional attention on text": (
        lambda: gemma4_config(use_bidirectional_attention="all"),
        "use_bidirectional_attention='all' is not",
    ),
    "gemma3 bidirectional attention (EmbeddingGemma)": (
        lambda: gemma3_config(use_bidirectional_attention=True),
        "use_bidirectional_attention=True is not",
    ),
    # sweepa (each field alone against transformers):
    # transformers' generate caches the last window - 1 keys, so all of them at 1: its tokens are no window's
    "mistral sliding window of 1 token": (
        lambda: MistralConfig(**COMMON, sliding_window=1, architectures=["MistralForCausalLM"]),
        "sliding_window 1 is not supported: a window holds at least 2 tokens",
    ),
    # transformers' mask and scores disagree in size: a shape error
    "qwen3-moe sliding window of 0 tokens": (
        lambda: qwen3_moe(use_sliding_window=True, sliding_window=0),
        "sliding_window 0 is not supported",
    ),
    # transformers' sliding mask takes a size: a TypeError
    "gemma3 sliding layers without a window": (
        lambda: gemma3_config(sliding_window=None),
        r"layer_types\[0\] is 'sliding_attention' but sliding_window is None",
    ),
    # sweepb (one field at a time): transformers repeats each KV head num_attention_heads // num_key_value_heads
    # times, a shape error where that does not divide (0 times here)
    "glm4-moe one query head over 2 kv heads": (
        lambda: Glm4MoeConfig(**{**GLM_MOE, "num_attention_heads": 1}),
        "num_attention_heads 1 is not a multiple of num_key_value_heads 2",
    ),
    "qwen3.5 one query head over 2 kv heads": (
        lambda: Qwen3_5TextConfig(**{**HYBRID, "num_attention_heads": 1}, architectures=["Qwen3_5ForCausalLM"]),
        "num_attention_heads 1 is not a multiple of num_key_value_heads 2",
    ),
    "gemma4 3 query heads over 2 kv heads": (
        lambda: gemma4_config(num_attention_heads=3),
        "num_attention_heads 3 is not a multiple of num_key_value_heads 2",
    ),
    # transformers builds a rotation wider than the head, then fails on its shape (fuzzed by a QA pass)
    "phi3 partial rotary factor above 1": (
        lambda: Phi3Config(
            **{**SMALL, "rope_parameters": {**DEFAULT_ROPE, "partial_rotary_factor": 2.0}},
            architectures=["Phi3ForCausalLM"],
        ),
        r"partial_rotary_factor 2.0 is not supported: it rotates 16 dims of a 8-dim head",
    ),
    "minimax-m2 rotary_dim above head_dim": (
        lambda: MiniMaxM2Config(**{**MINIMAX, "rotary_dim": 32}),
        r"partial_rotary_factor 2.0 is not supported: it rotates 32 dims of a 16-dim head",
    ),
    # transformers scores a group by its best two experts: an index out of range
    "glm4-moe groups of one expert": (
        lambda: Glm4MoeConfig(**{**GLM_MOE, "n_group": 16, "topk_group": 1, "num_experts_per_tok": 1}),
        "n_group 16 leaves one of the 16 experts a group",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_unsupported_value_is_one_error_naming_the_field(name, tmp_path):
    config, message = ERRORS[name]
    save_tiny_model(config(), tmp_path)
    with pytest.raises((ValueError, NotImplementedError), match=message):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


# sweepa: sizes a config class leaves null, where transformers fails to build the model (no weights to save)
NULL_SIZES: dict[str, tuple[Callable[[], PretrainedConfig], str]] = {
    "qwen2-moe num_key_value_heads null": (lambda: qwen2_moe(num_key_value_heads=None), "num_key_value_heads"),
    "glm num_key_value_heads null": (lambda: glm(num_key_value_heads=None), "num_key_value_heads"),
    "glm head_dim null": (lambda: glm(head_dim=None), "head_dim"),
}


@pytest.mark.parametrize("name", list(NULL_SIZES))
def test_a_null_size_is_one_error_naming_it(name, tmp_path):
    config, size = NULL_SIZES[name]
    config().save_pretrained(tmp_path)
    with pytest.raises(TypeError):  # transformers' own failure: the reference gives no output
        save_tiny_model(config(), tmp_path / "hf")
    with pytest.raises(ValueError, match=f"the config's {size} is null"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64)


def test_the_reference_caches_a_window_of_1_wrongly(tmp_path):
    """Why a sliding_window of 1 is refused: transformers' generate (its sliding cache keeps the last
    window - 1 keys, i.e. all of them) departs from its own forward over the whole sequence at each step."""
    hf = save_tiny_model(MistralConfig(**COMMON, sliding_window=1, architectures=["MistralForCausalLM"]), tmp_path)
    randomize(hf)
    tokens = prompt(13, seed=1)
    cached, _ = hf_greedy(hf, tokens, 4)
    uncached = list(tokens)
    with torch.inference_mode():
        for _ in range(4):
            uncached.append(int(hf(torch.tensor([uncached])).logits[0, -1].argmax()))
    assert cached[0] == uncached[len(tokens)]  # the prompt's step has no cache
    assert cached != uncached[len(tokens) :]


UNREAD_WINDOWS: dict[str, Callable[[], PretrainedConfig]] = {
    "llama": lambda: LlamaConfig(**SMALL, sliding_window=8, architectures=["LlamaForCausalLM"]),
    "glm4": lambda: glm4(sliding_window=8),
    "glm4-moe": lambda: Glm4MoeConfig(**{**GLM_MOE, "sliding_window": 8}),
    "minimax-m2": lambda: MiniMaxM2Config(**{**MINIMAX, "sliding_window": 8}),
}


@pytest.mark.parametrize("name", UNREAD_WINDOWS)
def test_a_window_the_attention_does_not_read_is_not_applied(name, tmp_path, caplog):
    """A prompt longer than the sliding_window gives transformers' logits: its attention has no window."""
    hf, llm = randomized_model(UNREAD_WINDOWS[name](), tmp_path)
    assert "sliding_window 8 is not read" in caplog.text
    assert_prefill_logits_match(hf, llm, 29)


def test_the_reference_windows_only_while_generating(tmp_path):
    """Why greedy tokens are not compared there: transformers' forward attends to every earlier token, while
    generate's cache (built from the config) keeps only the last window - 1 keys."""
    config = LlamaConfig(**SMALL, sliding_window=4, architectures=["LlamaForCausalLM"])
    hf = save_tiny_model(config, tmp_path)
    randomize(hf)
    tokens = prompt(13, seed=1)
    _, cached = hf_greedy(hf, tokens, 4)
    uncached, whole = list(tokens), []
    with torch.inference_mode():
        for _ in range(4):
            logits = hf(torch.tensor([uncached])).logits[0, -1]
            whole.append(torch.log_softmax(logits, dim=-1).max().item())
            uncached.append(int(logits.argmax()))
    assert cached[0] == pytest.approx(whole[0], abs=1e-5)  # the prompt's step has no cache
    assert cached[1:] != pytest.approx(whole[1:], abs=1e-3)


# sweepb (one field at a time): values transformers fails on as it builds the model
UNBUILT: dict[str, tuple[Callable[[], PretrainedConfig], str]] = {
    # transformers divides the frequencies by the factors, one per rotated pair: a shape error
    "qwen3-moe longrope factors for half the rotated pairs": (
        lambda: qwen3_moe(head_dim=16, rope_parameters=LONGROPE),
        "short_factor has 4 values, not the 8 of the 16 rotated dims' pairs",
    ),
    # transformers looks each layer type's rope up by its name in rope_parameters: a KeyError
    "gemma4 one rope dict for every layer type": (
        lambda: gemma4_config(rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        "rope_parameters has no 'sliding_attention' entry",
    ),
}


@pytest.mark.parametrize("name", list(UNBUILT))
def test_a_value_transformers_cannot_build_is_one_error_naming_the_field(name, tmp_path):
    config, message = UNBUILT[name]
    with pytest.raises((RuntimeError, KeyError)):
        AutoModelForCausalLM.from_config(config())
    config().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64, load_format="dummy")


# fields an architecture's transformers code does not read, set anyway (configs converted or merged from another
# family carry them): each changed the output or asked the checkpoint for biases transformers never made
UNREAD = dict(final_logit_softcapping=0.5, query_pre_attn_scalar=4, hidden_activation="relu", qkv_bias=True)
NOT_READ: dict[str, Callable[[], PretrainedConfig]] = {
    "llama: another family's softcap, query scalar, activation field, qkv_bias": lambda: LlamaConfig(
        **SMALL, **UNREAD, architectures=["LlamaForCausalLM"]
    ),
    "mistral: biases too": lambda: MistralConfig(
        **SMALL, **UNREAD, attention_bias=True, mlp_bias=True, architectures=["MistralForCausalLM"]
    ),
    "phi3: biases too": lambda: phi3_longrope_config(**UNREAD, attention_bias=True, mlp_bias=True),
    "qwen2: an o and MLP bias": lambda: Qwen2Config(
        **SMALL, **UNREAD, attention_bias=True, mlp_bias=True, architectures=["Qwen2ForCausalLM"]
    ),
    "qwen3: an MLP bias": lambda: Qwen3Config(**SMALL, **UNREAD, mlp_bias=True, architectures=["Qwen3ForCausalLM"]),
    "qwen3-moe dense layer: an MLP bias": lambda: qwen3_moe(**UNREAD, mlp_bias=True, mlp_only_layers=[1]),
    "glm: an MLP bias": lambda: glm(**UNREAD, mlp_bias=True),
    "gemma3: hidden_act and biases": lambda: gemma3_config(hidden_act="relu", qkv_bias=True, mlp_bias=True),
    "minimax-m2: biases": lambda: MiniMaxM2Config(**{**MINIMAX, **UNREAD, "attention_bias": True, "mlp_bias": True}),
}  # fmt: skip


@pytest.mark.parametrize("name", list(NOT_READ))
def test_fields_the_architecture_does_not_read_change_nothing(name, tmp_path):
    assert_prefill_logits_match(*randomized_model(NOT_READ[name](), tmp_path), 29)
