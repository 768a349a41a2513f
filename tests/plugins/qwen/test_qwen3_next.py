"""Qwen3-Next, Qwen3.5 / Qwen3.6 dense and MoE (hybrid: Gated DeltaNet and full-attention layers)
against transformers' modeling code (fp32, CPU): log-probs at every prompt position, greedy tokens
and their log-probs with prompts chunked across steps, several sequences batched at different
lengths, preempted ones recomputed, and two requests sharing a prefix. (Qwen3.5's image-text
checkpoints: test_qwen3_5_vl.py.)"""

import pytest
import torch
from transformers import (
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    randomize,
    spread_routing,
)
from tests.tiny_models import COMMON, prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.engine import memory_plan
from xinfer.layers.activation import check_op_activations_run_on
from xinfer_cpu.ops import CpuOps
from xinfer_cuda.ops import CudaOps
from xinfer_qwen.gated_deltanet import GatedDeltaNet

CHUNK = 16  # max_num_batched_tokens: prompts longer than this are prefilled over several steps
HYBRID = dict(
    COMMON,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    head_dim=32,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
    linear_num_key_heads=2,
    linear_num_value_heads=4,  # two value heads per key head
    linear_key_head_dim=16,
    linear_value_head_dim=24,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
)
# a shared expert of an expert's size, as Qwen3.6-35B-A3B's: run as one more routed expert, gated (MoE.finish_loading)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
CONFIGS = {
    "qwen3.5": lambda: Qwen3_5TextConfig(**HYBRID, architectures=["Qwen3_5ForCausalLM"]),
    "qwen3.5-moe": lambda: Qwen3_5MoeTextConfig(
        **{k: v for k, v in HYBRID.items() if k != "intermediate_size"}, **EXPERTS,
        architectures=["Qwen3_5MoeForCausalLM"],
    ),
    # layer 1 dense (mlp_only_layers), raw top-k weights
    "qwen3-next": lambda: Qwen3NextConfig(
        **HYBRID, **EXPERTS, mlp_only_layers=[1], norm_topk_prob=False, architectures=["Qwen3NextForCausalLM"]
    ),
}  # fmt: skip
VARIANTS = {  # each flips fields the CONFIGS leave at one value
    # transformers applies hidden_act in the DeltaNet's short convolution too, not only in the MLP
    "qwen3.5 gelu_pytorch_tanh": lambda: Qwen3_5TextConfig(
        **HYBRID, hidden_act="gelu_pytorch_tanh", architectures=["Qwen3_5ForCausalLM"]
    ),
    # an activation no backend fuses, in the conv and the experts; three value heads a key head, a conv of 2 taps
    "qwen3.5-moe quick_gelu, 3 value heads per key head, kernel 2": lambda: Qwen3_5MoeTextConfig(
        **{k: v for k, v in HYBRID.items() if k != "intermediate_size"} | dict(linear_num_value_heads=6,
        linear_conv_kernel_dim=2), **EXPERTS, hidden_act="quick_gelu", architectures=["Qwen3_5MoeForCausalLM"],
    ),
}  # fmt: skip


def deltanet_alone(config):
    """``config`` with two layers, both DeltaNet layers (as the default ``full_attention_interval`` of 4 makes them)."""
    config.num_hidden_layers, config.layer_types = 2, ["linear_attention"] * 2
    return config


def randomize_hybrid(model: torch.nn.Module, seed: int = 3) -> None:
    """Norms (zero-centred ones too) and biases via :func:`randomize`; each DeltaNet's decay
    parameters away from HF's initial ones (``dt_bias`` is all ones there): ``A_log`` with decay
    rates from 0.5 to 4, ``dt_bias`` around 0, so that a head's decay differs from the next's."""
    randomize(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.5, 4, generator=generator).log())
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=generator))


def randomized_hybrid(config, folder) -> tuple[torch.nn.Module, LLM]:
    hf = save_tiny_model(config, folder)
    randomize_hybrid(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return *randomized_hybrid(CONFIGS[request.param](), folder), folder


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    return randomized_hybrid(VARIANTS[request.param](), tmp_path_factory.mktemp("variant"))


def hf_greedy(hf: torch.nn.Module, tokens: list[int], count: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([tokens]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return out[0, len(tokens) :].tolist()


@pytest.mark.parametrize("length", (3, 17, 61))
def test_prefill_log_probs_match_hf(models, length):
    hf, llm, _ = models
    tokens = prompt(length)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0].log_softmax(-1)
    got = prefill_logits(llm.engine, tokens).float().log_softmax(-1)
    error = (got - expected).abs().max()
    assert error <= 1e-4, f"max|diff| of log-probs = {error:.2e}"


@pytest.mark.parametrize("length", (3, 40))
def test_variant_prefill_logits_match_hf(variant, length):
    assert_prefill_logits_match(*variant, length)


def test_variant_greedy_tokens_and_logprobs_match_hf_over_a_chunked_prompt(variant):
    assert_greedy_tokens_and_logprobs_match(*variant, 3 * CHUNK - 5)


def test_the_cuda_conv_kernel_takes_silu_alone_and_the_cpu_every_activation():
    for name in ("gelu_pytorch_tanh", "relu2"):
        deltanet = GatedDeltaNet(Qwen3_5TextConfig(**HYBRID, hidden_act=name))
        check_op_activations_run_on(deltanet, CpuOps())
        with pytest.raises(NotImplementedError, match=f"hidden_act {name!r} is not supported in causal_conv1d on cuda"):
            check_op_activations_run_on(deltanet, CudaOps())
    check_op_activations_run_on(GatedDeltaNet(Qwen3_5TextConfig(**HYBRID, hidden_act="swish")), CudaOps())


UNBUILT = {  # values transformers fails on as it builds the model: one error at start-up naming the field
    # dynamic NTK raises the base to the power dim / (dim - 2)
    "dynamic rope over 2 rotated dims": (
        lambda: Qwen3_5TextConfig(**{**HYBRID, "head_dim": 8, "rope_parameters": dict(
            rope_type="dynamic", rope_theta=10000.0, factor=2.0, partial_rotary_factor=0.25)}),
        Qwen3_5ForCausalLM,
        r"rope_type 'dynamic' over 2 rotated dims \(head_dim \* partial_rotary_factor\)",
    ),
    # a layer is sparse where (its index + 1) modulo the step is 0
    "qwen3-next decoder_sparse_step 0": (
        lambda: Qwen3NextConfig(**HYBRID, **EXPERTS, decoder_sparse_step=0),
        Qwen3NextForCausalLM,
        "decoder_sparse_step 0 is not supported",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(UNBUILT))
def test_a_value_transformers_cannot_build_is_one_error_naming_the_field(name, tmp_path):
    config, transformers_class, message = UNBUILT[name]
    with pytest.raises(ZeroDivisionError):
        transformers_class(config())
    saved = config()
    saved.architectures = [transformers_class.__name__]
    saved.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64, load_format="dummy")


def test_greedy_tokens_and_logprobs_match_hf_over_a_chunked_prompt(models):
    hf, llm, _ = models
    assert_greedy_tokens_and_logprobs_match(hf, llm, 3 * CHUNK - 5)


def test_sequences_batched_at_different_lengths_and_preempted_match_hf(models):
    hf, _, folder = models
    prompts = [prompt(4 + 23 * i, seed=i) for i in range(3)]
    expected = [hf_greedy(hf, tokens, 10) for tokens in prompts]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    small = LLM(model=str(folder), dtype="float32", num_blocks=5, max_model_len=80, max_num_batched_tokens=CHUNK)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == expected
    assert small.engine.stats().num_preemptions > 0
    states = small.engine.cache.states
    assert states is not None and states.num_free == states.num_slots


def test_two_requests_sharing_a_prefix_match_hf(models):
    hf, llm, _ = models
    shared = prompt(37, seed=7)
    prompts = [shared + prompt(5, seed=8), shared + prompt(9, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for tokens in prompts:  # one after the other: the second finds the first's blocks
        assert llm.generate([tokens], params)[0].outputs[0].token_ids == hf_greedy(hf, tokens, 6)


def uncached_greedy(hf: torch.nn.Module, tokens: list[int], count: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation without a cache, and each chosen token's log-probability: with no
    attention layer its cache has nothing to size a mask by, and ``generate`` fails where ``forward`` runs."""
    sequence, chosen, logprobs = list(tokens), [], []
    with torch.inference_mode():
        for _ in range(count):
            step = hf(torch.tensor([sequence]), use_cache=False).logits[0, -1].log_softmax(-1)
            chosen.append(int(step.argmax()))
            logprobs.append(step[chosen[-1]].item())
            sequence.append(chosen[-1])
    return chosen, logprobs


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_model_of_deltanet_layers_alone_matches_hf(name, tmp_path):
    """Two layers under the default ``full_attention_interval`` (4) are both DeltaNet layers: nothing is paged,
    each sequence has its state slot alone; chunked prompts, a batch of three lengths, and a prefix hit."""
    hf, llm = randomized_hybrid(deltanet_alone(CONFIGS[name]()), tmp_path)
    tokens = prompt(40)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens]), use_cache=False).logits[0].log_softmax(-1)
    torch.testing.assert_close(
        prefill_logits(llm.engine, tokens).float().cpu().log_softmax(-1), expected, atol=1e-4, rtol=0
    )
    shared = prompt(37, seed=7)
    prompts = [shared + prompt(5, seed=8), prompt(4, seed=1), shared + prompt(9, seed=9)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outputs = [llm.generate([prompts[0]], params)[0].outputs[0]]  # then the third finds its prefix's state
    outputs += [out.outputs[0] for out in llm.generate(prompts[1:], params)]
    for tokens, out in zip(prompts, outputs):
        expected_tokens, expected_logprobs = uncached_greedy(hf, tokens, 8)
        assert out.token_ids == expected_tokens
        got = [step[token] for step, token in zip(out.logprobs, out.token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected_logprobs), atol=1e-4, rtol=0)
    assert llm.engine.stats().prefix_cache_hits == 2  # the shared 37 tokens' two whole blocks


def test_a_model_of_deltanet_layers_alone_gives_its_states_and_snapshots_the_whole_cache_budget(tmp_path, monkeypatch):
    save_tiny_model(deltanet_alone(CONFIGS["qwen3.5"]()), tmp_path)
    budget = 1 << 20
    monkeypatch.setattr(memory_plan, "host_kv_budget", lambda fraction: budget)
    engine = LLM(model=str(tmp_path), dtype="float32", max_num_seqs=1024).engine
    states = engine.cache.states
    assert states is not None
    slot_bytes = sum(t[0].nbytes for cache in engine.runner.state_caches for t in cache.values())
    held = (states.num_slots + states.num_snapshots) * slot_bytes
    assert budget - 2 * slot_bytes < held <= budget
    assert states.num_snapshots == -(-states.num_slots // 4)


def test_a_longrope_prompt_past_the_trained_context_over_a_snapshot_point_matches_hf(tmp_path):
    """Qwen3.5 with LongRoPE trained at 16 positions: a 30-token prompt is turned the long way at every position, so
    its first chunk passes the state snapshot point at its last block boundary (16) rather than stop there (the
    engine used to wait for a chunk that could never come)."""
    longrope = dict(
        rope_type="longrope", rope_theta=10000.0, partial_rotary_factor=0.25, original_max_position_embeddings=16,
        short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.5, 3.0, 7.0, 15.0],
    )  # fmt: skip
    config = Qwen3_5TextConfig(**{**HYBRID, "rope_parameters": longrope, "architectures": ["Qwen3_5ForCausalLM"]})
    hf = save_tiny_model(config, tmp_path)
    randomize_hybrid(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK)
    assert_greedy_tokens_and_logprobs_match(hf, llm, 30)
