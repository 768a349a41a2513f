"""Tensor parallel 2 against 1 (CPU, gloo, fp32): every architecture family gives the same greedy
tokens, and the log-probability of each within 1e-4, from tiny random models whose norms, biases
and routers are randomized. Both ranks' processes are started once for the module (the first rank
is this process); each model's two engines run one after the other."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from transformers import (
    DeepseekV32Config,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from tests.plugins.deepseek.configs import deepseek_v2_config, deepseek_v3_config, glm4_moe_lite_config, latent_settings
from tests.plugins.gemma.test_gemma4 import E_MODEL, MOE, gemma4_config
from tests.plugins.glm.configs import glm4_config, glm4_moe_config
from tests.plugins.hf_parity import randomize, spread_routing
from tests.plugins.minimax.test_minimax_m2 import minimax_m2_config
from tests.plugins.qwen.test_qwen3_next import CONFIGS as HYBRID_CONFIGS
from tests.plugins.qwen.test_qwen3_next import deltanet_alone, randomize_hybrid
from tests.plugins.qwen.test_qwen_moe import CONFIGS as MOE_CONFIGS
from tests.tiny_models import COMMON, gemma3_config, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.distributed.ranks import started

DEVICE = os.environ.get("XINFER_TP_DEVICE", "cpu")  # "cuda" on a machine of two GPUs or more (ranks on 0 and 1)
NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
PROMPTS = [prompt(5), prompt(37, seed=1)]  # the long one over two steps

V32 = latent_settings() | dict(
    index_topk=8, index_n_heads=8, index_head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"],
    architectures=["DeepseekV32ForCausalLM"],
)  # fmt: skip
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]),
    "qwen2": lambda: Qwen2Config(**COMMON, architectures=["Qwen2ForCausalLM"]),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, architectures=["Qwen3ForCausalLM"]),  # q/k norms
    "qwen3-kv1": lambda: Qwen3Config(  # one KV head on both ranks
        **{**COMMON, "num_key_value_heads": 1}, head_dim=32, architectures=["Qwen3ForCausalLM"]
    ),
    "gemma3": gemma3_config,  # tied embeddings, soft-capping off, sliding layers
    "glm4": glm4_config,  # interleaved partial rotary
    "glm4-moe": glm4_moe_config,
    "minimax-m2": minimax_m2_config,  # q/k norms across every head
    "deepseek-v3": deepseek_v3_config,  # latent attention (q-LoRA), grouped routing
    "deepseek-v2": deepseek_v2_config,  # latent attention without q-LoRA
    "glm4-moe-lite": glm4_moe_lite_config,
    "deepseek-v32": lambda: DeepseekV32Config(**V32),  # the indexer whole on every rank
    "gemma4": gemma4_config,  # attention of its own (one KV head on the global layers), soft-capping
    "gemma4-e": lambda: gemma4_config(**E_MODEL),  # per-layer embeddings, KV-shared layers
    "gemma4-moe": lambda: gemma4_config(**MOE),
    **MOE_CONFIGS,  # qwen2-moe (shared expert), qwen3-moe
    **HYBRID_CONFIGS,  # qwen3.5, qwen3.5-moe, qwen3-next: Gated DeltaNet
    "qwen3.5 deltanet alone": lambda: deltanet_alone(HYBRID_CONFIGS["qwen3.5"]()),  # nothing paged
}


@pytest.fixture(scope="module")
def ranks():
    with started(tensor_parallel_size=2, device=DEVICE) as group:
        yield group


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    @functools.cache  # llama's and qwen3-moe's serve two tests each
    def save(name: str):
        folder = tmp_path_factory.mktemp(name)
        hf = save_tiny_model(CONFIGS[name](), folder)
        (randomize_hybrid if name.startswith(("qwen3.5", "qwen3-next")) else randomize)(hf)
        spread_routing(hf)
        hf.save_pretrained(folder, safe_serialization=True)
        return folder

    return save


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_ranks_give_one_ranks_tokens_and_logprobs(name, checkpoints, ranks):
    folder = str(checkpoints(name))
    options = dict(model=folder, dtype="float32", num_blocks=64, max_num_batched_tokens=32, device=DEVICE)  # 2 chunks
    one = LLM(**options).generate(PROMPTS, GREEDY)
    with LLM(**options, tensor_parallel_size=2) as llm:
        two = llm.generate(PROMPTS, GREEDY)
    for a, b in zip(one, two):
        a, b = a.outputs[0], b.outputs[0]
        assert b.token_ids == a.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        for x, y, token in zip(a.logprobs, b.logprobs, a.token_ids):
            assert abs(x[token] - y[token]) <= 1e-4


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3-next"])
def test_a_hybrid_s_prefix_hit_and_preemptions_give_one_ranks_tokens(name, checkpoints, ranks):
    """A prefix hit restores a recurrent state snapshot, snapshots are taken at block boundaries and a preempted
    sequence gives its slot back: copies between state slots that the first rank's scheduler decides, which the
    other ranks did not make (their share of the Gated DeltaNet heads went on from another state)."""
    shared = prompt(40, seed=3)
    prompts = [shared + prompt(5, seed=4), prompt(12, seed=5), shared + prompt(9, seed=6)]
    options = dict(model=str(checkpoints(name)), dtype="float32", max_num_batched_tokens=32, device=DEVICE)
    one = LLM(**options, num_blocks=64)
    expected = [one.generate([p], GREEDY)[0].outputs[0].token_ids for p in prompts]  # the last hits the first's
    with LLM(**options, num_blocks=64, tensor_parallel_size=2) as llm:
        outputs = [llm.generate([p], GREEDY)[0] for p in prompts]
    assert outputs[2].num_cached_tokens > 0
    assert [out.outputs[0].token_ids for out in outputs] == expected
    small = dict(options, num_blocks=7, max_model_len=96)
    expected = [out.outputs[0].token_ids for out in LLM(**small).generate(prompts * 2, GREEDY)]
    with LLM(**small, tensor_parallel_size=2) as llm:
        assert [out.outputs[0].token_ids for out in llm.generate(prompts * 2, GREEDY)] == expected
        assert llm.engine.stats().num_preemptions > 0


def test_heads_that_do_not_split_are_refused_in_one_line(tmp_path, checkpoints, ranks):
    three_heads = {**COMMON, "hidden_size": 48, "num_attention_heads": 3, "num_key_value_heads": 1}
    save_tiny_model(LlamaConfig(**three_heads, architectures=["LlamaForCausalLM"]), tmp_path)
    with pytest.raises(ValueError, match=r"^tensor parallel 2: attention heads \(3\) does not split evenly"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=16, tensor_parallel_size=2, device=DEVICE)
    llama = str(checkpoints("llama"))  # the ranks still serve the next engine
    with LLM(model=llama, dtype="float32", num_blocks=64, tensor_parallel_size=2, device=DEVICE) as llm:
        assert len(llm.generate([prompt(4)], GREEDY)[0].outputs[0].token_ids) == NEW_TOKENS


def test_hidden_states_of_two_ranks_are_one_ranks(checkpoints, ranks):
    """The forward between steps (embeddings, prompt logprobs) runs on every rank too."""
    options = dict(model=str(checkpoints("qwen3-moe")), dtype="float32", num_blocks=64, device=DEVICE)
    one = LLM(**options).engine
    expected, expected_logprobs = one.hidden_states(prompt(23)), one.prompt_logprobs(prompt(23), 2)
    with LLM(**options, tensor_parallel_size=2) as llm:
        torch.testing.assert_close(llm.engine.hidden_states(prompt(23)), expected, atol=1e-4, rtol=1e-4)
        logprobs = llm.engine.prompt_logprobs(prompt(23), 2)  # the LM head's vocabulary split over the ranks
        assert logprobs[0] is None and [list(e) for e in logprobs[1:]] == [list(e) for e in expected_logprobs[1:]]
        for got, want in zip(logprobs[1:], expected_logprobs[1:]):
            assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
