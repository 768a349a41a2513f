"""DeepseekV3ForCausalLM with ``--kvcache-dtype fp8``: the latent cache holds fp8 rows (mla_ops.py's layout),
on the CPU backend (fp32). The oracle is transformers' modeling code with the latent and rope key passed
through what the fp8 rows give back (the latent in e4m3 on its groups' absmax, the rope key in bf16) before
``expand_kv``: the same attention over the same stored values, expanded. Against it, tokens match and
log-probabilities stay within the 1e-4 of every HF-parity test (measured: 1e-6; without the rows' rounding in
the oracle, 1.4e-2 to 4.6e-2). Against the unquantized cache, whose distance is that rounding alone (a latent
error up to 1/16 of each value), the fp8 cache stays within 0.1 (twice that measured worst). Prefix caching
and preemption hold, and the planner fits 1152 / 656 = 1.76x the tokens of bf16 in the same memory at V3's
latent sizes."""

import pytest
import torch

from tests.plugins.deepseek.configs import deepseek_v3_config
from tests.plugins.deepseek.test_mla_op import dequantized
from tests.plugins.hf_parity import (
    assert_output_matches_hf,
    assert_preempted_sequences_match_hf,
    assert_prefix_hit_mid_prompt_matches_hf,
    randomize,
    spread_routing,
)
from tests.tiny_models import prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams, registry
from xinfer.cache.allocate import CacheLayout
from xinfer.engine.memory_plan import split_budget
from xinfer.kv import get_format
from xinfer_deepseek import mla_ops
from xinfer_deepseek.kernels import mla

CHUNK = 32
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
ORACLE_TOL = 1e-4


def through_fp8_rows(hf) -> None:
    """Every attention layer of ``hf`` expands the latent and rope key as the fp8 rows give them back."""
    rank = hf.config.kv_lora_rank
    for layer in hf.model.layers:
        attention, expand = layer.self_attn, layer.self_attn.expand_kv

        def expand_stored(latent, k_rope, expand=expand):
            rows = torch.cat([latent, k_rope], dim=-1)
            stored = dequantized(rows.flatten(0, -2), rank).view(rows.shape)
            return expand(*stored.split([rank, rows.shape[-1] - rank], dim=-1))

        attention.expand_kv = expand_stored


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v3-fp8")
    hf = save_tiny_model(deepseek_v3_config(), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    through_fp8_rows(hf)
    return hf, folder


@pytest.fixture(scope="module")
def fp8(checkpoint):
    _, folder = checkpoint
    return LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK, kv_cache_dtype="fp8")


def test_the_op_runs_its_reference_and_its_cuda_kernel():
    spec = registry.op_specs()["mla_attention_fp8"]
    assert registry.load_object(spec.reference) is mla_ops.mla_attention_fp8
    assert registry.load_object(spec.kernels["cuda"]) is mla.mla_attention_fp8


def test_the_cache_holds_fp8_rows(fp8):
    caches = [layer.self_attn.cache for layer in fp8.engine.model.model.layers]
    (pool,) = fp8.engine.cache.pools
    assert all(c.dtype == torch.uint8 and tuple(c.shape) == (pool.num_blocks, 16, 32 + 4 + 2 * 8) for c in caches)


@pytest.mark.parametrize("length", (3, 40))
def test_prefill_logits_match_transformers_over_the_stored_rows(checkpoint, fp8, length):
    hf, _ = checkpoint
    tokens = prompt(length)
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([tokens])).logits[0], dim=-1)
    got = torch.log_softmax(prefill_logits(fp8.engine, tokens), dim=-1)
    torch.testing.assert_close(got, expected, atol=ORACLE_TOL, rtol=0)


def test_greedy_tokens_and_logprobs_match_transformers_over_the_stored_rows(checkpoint, fp8):
    hf, _ = checkpoint
    tokens = prompt(40, seed=1)
    output = fp8.generate([tokens], GREEDY)[0].outputs[0]
    assert_output_matches_hf(hf, tokens, output, NEW_TOKENS, atol=ORACLE_TOL)


def test_a_prefix_cache_hit_mid_prompt_matches(checkpoint, fp8):
    assert_prefix_hit_mid_prompt_matches_hf(checkpoint[0], fp8, GREEDY, ORACLE_TOL)


def test_preempted_sequences_match(checkpoint):
    hf, folder = checkpoint
    llm = LLM(model=str(folder), dtype="float32", num_blocks=7, max_model_len=96, max_num_batched_tokens=CHUNK,
              kv_cache_dtype="fp8")  # fmt: skip
    assert_preempted_sequences_match_hf(hf, llm, GREEDY, ORACLE_TOL)


def test_the_fp8_cache_stays_close_to_the_unquantized_one(checkpoint, fp8):
    """As tests/kv/test_engine_formats.py asks of fp8 attention caches: the first greedy token agrees on most
    prompts; and every prompt position's log-probabilities stay within 0.1 of the unquantized cache's."""
    _, folder = checkpoint
    plain = LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK)
    prompts = [prompt(40, seed=10 + i) for i in range(4)]
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(plain.generate(prompts, first), fp8.generate(prompts, first)))  # fmt: skip
    assert same >= 3
    for tokens in prompts:
        expected = torch.log_softmax(prefill_logits(plain.engine, tokens), dim=-1)
        got = torch.log_softmax(prefill_logits(fp8.engine, tokens), dim=-1)
        torch.testing.assert_close(got, expected, atol=0.1, rtol=0)


def test_the_planner_fits_1_76x_the_tokens_of_bf16_at_v3_latent_sizes(tmp_path):
    """R 512, P 64: 656 bytes a token and layer against 1152 in bf16, both allocated as planned."""
    save_tiny_model(deepseek_v3_config(kv_lora_rank=512, qk_rope_head_dim=64), tmp_path)
    planned = {}
    for fmt in ("auto", "fp8"):
        engine = LLM(model=str(tmp_path), dtype="bfloat16", num_blocks=4, max_model_len=64, kv_cache_dtype=fmt).engine
        layout = CacheLayout.of(engine.model)
        block_bytes = layout.block_bytes(16, get_format(fmt), torch.bfloat16)
        allocated = sum(layer.cache.numel() * layer.cache.element_size() for layer in layout.layers)
        assert allocated == 4 * block_bytes[0]
        assert block_bytes[0] == engine.model.config.num_hidden_layers * 16 * {"auto": 1152, "fp8": 656}[fmt]
        (planned[fmt],) = split_budget(1 << 30, block_bytes, [None], 16, 1024, 256)
    assert planned["fp8"] / planned["auto"] == pytest.approx(1152 / 656, rel=1e-3)


@pytest.mark.parametrize("kv_cache_dtype", ["turbo8", "turbo4", "turbo3"])
def test_turbo_formats_are_refused_naming_fp8(tmp_path, kv_cache_dtype):
    save_tiny_model(deepseek_v3_config(), tmp_path)
    with pytest.raises(ValueError, match=f"^kv_cache_dtype .*'{kv_cache_dtype}'.*: use fp8 or auto$"):
        LLM(model=str(tmp_path), dtype="float32", num_blocks=64, kv_cache_dtype=kv_cache_dtype)
