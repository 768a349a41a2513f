"""benchmarks/floor.py (``offline.py --floor``): the FLOPs and weight bytes it counts against the parameters of
the models the plugins build, and the steps it records of a real run against a hand count of the workload."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as the scripts import each other
import floor
from shapes import SHAPES, weight_bytes

from tests.tiny_models import COMMON
from xinfer import LLM, SamplingParams
from xinfer.loading.loader import build_model


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(**COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def tiny_qwen3() -> Qwen3Config:
    return Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"])


def projection_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if name.endswith("_proj.weight"))


def logit_params(model: torch.nn.Module, config: PretrainedConfig) -> int:
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    return dict(model.named_parameters())[head].numel()


@pytest.mark.parametrize("make_config", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3-tied"])
def test_counts_match_the_models_parameters(make_config):
    config = make_config()
    model = build_model(config, torch.device("cpu"), torch.bfloat16)
    assert floor.refusal(config) is None
    assert floor.linear_params(config) == projection_params(model)
    assert floor.lm_head_params(config) == logit_params(model, config)
    embedding = model.get_parameter("model.embed_tokens.weight")
    read = sum(p.nbytes for p in model.parameters()) - (0 if config.tie_word_embeddings else embedding.nbytes)
    assert weight_bytes(config, 2) == read  # a step reads every weight once, the embedding only by rows


def test_moe_and_sliding_shapes_are_refused():
    assert "qwen3_moe" in floor.refusal(SHAPES["qwen3-30b-a3b"]())
    assert "gemma3_text" in floor.refusal(SHAPES["gemma3-4b-vision"]().get_text_config())
    assert "sliding" in floor.refusal(MistralConfig(**COMMON, sliding_window=16))
    assert floor.refusal(MistralConfig(**COMMON, sliding_window=None)) is None
    assert floor.refusal(SHAPES["llama-3.1-8b"]()) is None
    assert floor.refusal(SHAPES["qwen3-0.6b"]()) is None


INPUTS, OUTPUTS = [5, 40, 17], [3, 1, 6]
MAX_SEQS, MAX_TOKENS = 2, 32  # the 40-token prompt in two chunks; the third request waits for a slot


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[LLM, list[floor.Step]]:
    folder = tmp_path_factory.mktemp("llama")
    tiny_llama().save_pretrained(folder)
    llm = LLM(model=str(folder), load_format="dummy", dtype="float32", device="cpu",
              max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_TOKENS)  # fmt: skip
    steps = floor.record_steps(llm.engine.runner)
    prompts = [[(7 * n + i) % COMMON["vocab_size"] for i in range(n)] for n in INPUTS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in OUTPUTS]
    llm.generate(prompts, params)
    return llm, steps


def test_a_runs_steps_count_its_workload(run):
    llm, steps = run
    config = llm.engine.hf_config
    model = llm.engine.model
    computed = [p + o - 1 for p, o in zip(INPUTS, OUTPUTS)]  # the last output token is sampled, never fed back
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    d = h // heads
    by_hand = sum(
        2 * projection_params(model) * n  # every computed token through the layers' projections
        + 2 * logit_params(model, config) * o  # logits at the prompt's last token and at each decode token
        + layers * 2 * 2 * heads * d * n * (n + 1) // 2  # QK^T and PV: position p sees p + 1 keys
        for n, o in zip(computed, OUTPUTS)
    )
    assert sum(floor.step_flops(config, step) for step in steps) == by_hand
    assert sum(step.sampled for step in steps) == sum(OUTPUTS)
    # each request: its prompt's chunks, then one step per further token; at most 2 sampled per step
    assert floor.min_steps(INPUTS, OUTPUTS, MAX_SEQS, MAX_TOKENS) == max(1 + 5, 2 + 0, math.ceil(69 / 32), 10 // 2)
    assert len(steps) >= floor.min_steps(INPUTS, OUTPUTS, MAX_SEQS, MAX_TOKENS)


def test_the_floor_takes_each_steps_longer_bound(run):
    llm, steps = run
    config = llm.engine.hf_config
    prefill, decode = floor.Step([0, 32], [32], 1), floor.Step([0, 1, 2], [33, 10], 2)
    rates = floor.Rates(flops_per_s=1e9, bytes_per_s=1e9)
    flops = [floor.step_flops(config, prefill), floor.step_flops(config, decode)]
    nbytes = [floor.step_bytes(10**6, 1000, prefill), floor.step_bytes(10**6, 1000, decode)]
    assert nbytes == [10**6 + 32_000, 10**6 + 43_000]  # the weights; the KV read and written
    assert floor.floor_seconds(flops, nbytes, rates) == pytest.approx(flops[0] / 1e9 + nbytes[1] / 1e9)
    assert flops[0] > nbytes[0] and flops[1] < nbytes[1]  # a compute-bound step, a memory-bound one

    figures = floor.report(config, steps, 4, 1000, rates, sum(OUTPUTS), seconds=0.5)
    weights = weight_bytes(config, 4)
    seconds = floor.floor_seconds([floor.step_flops(config, step) for step in steps],
                                  [floor.step_bytes(weights, 1000, step) for step in steps], rates)  # fmt: skip
    assert figures["floor_output_tok_s"] == pytest.approx(sum(OUTPUTS) / seconds, rel=1e-3)
    assert figures["fraction_of_floor"] == pytest.approx(seconds / 0.5, abs=1e-3)
