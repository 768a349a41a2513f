"""A seeded request draws the same tokens alone, among batches of different mixes, and
when preempted and recomputed; requests without a seed still draw at random."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams

SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=21, max_tokens=30, ignore_eos=True)
OTHERS = [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.3, top_k=5, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=40, ignore_eos=True),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    return str(folder)


def tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_a_seeded_request_draws_the_same_tokens_whatever_the_batch(model_dir):
    llm = LLM(model=model_dir, dtype="float32", num_blocks=256, max_num_batched_tokens=256)
    mine = prompt(25, seed=1)
    alone = tokens(llm, [mine], [SEEDED])[0]
    for mix in ([0], [1, 2], [2, 0, 1, 1]):
        others = [prompt(10 + 13 * i, seed=5 + i) for i in range(len(mix))]
        got = tokens(llm, [*others, mine], [OTHERS[i] for i in mix] + [SEEDED])
        assert got[-1] == alone, mix
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    first, second = tokens(llm, [mine, mine], [unseeded, unseeded])
    assert first != second
    minus_one = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=-1)  # vLLM's: no seed
    assert minus_one.seed is None
    first, second = tokens(llm, [mine], [minus_one]) + tokens(llm, [mine], [minus_one])
    assert first != second


def test_a_seeded_request_draws_the_same_tokens_after_preemption(model_dir):
    prompts = [prompt(30, seed=i) for i in range(8)]
    params = [SEEDED if i % 2 else OTHERS[2] for i in range(8)]
    roomy = LLM(model=model_dir, dtype="float32", num_blocks=256)
    expected = tokens(roomy, prompts, params)
    small = LLM(model=model_dir, dtype="float32", num_blocks=8, max_model_len=128, block_size=16)
    assert tokens(small, prompts, params) == expected
    assert small.engine.stats().num_preemptions > 0
