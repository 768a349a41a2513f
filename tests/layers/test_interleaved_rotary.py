"""Interleaved (GPT-J style) rotary through the NeoX-style ``ops.rotary``: q/k rows reordered
at load (``pairs_to_halves``), against transformers' GLM, which rotates adjacent pairs of the
first half of each head (fp32, CPU); end to end through the GLM plugin's ``GlmForCausalLM``."""

import pytest
import torch
from transformers.models.glm.modeling_glm import GlmRotaryEmbedding, apply_rotary_pos_emb

from tests.plugins.glm.configs import glm_config
from tests.tiny_models import prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams, ops
from xinfer.layers import RotaryEmbedding, pairs_to_halves, rope_parameters
from xinfer_cpu.ops import CpuOps


def test_reordered_rows_rotated_as_halves_equal_pairs_rotated():
    config = glm_config()
    tokens, heads, head_dim = 9, config.num_attention_heads, config.head_dim
    generator = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, tokens, heads, head_dim, generator=generator)
    positions = torch.arange(tokens) * 37
    rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, rope_parameters(config))

    def reordered(x: torch.Tensor) -> torch.Tensor:  # what a projection with reordered rows gives
        return pairs_to_halves(x.reshape(tokens, -1).T, heads, rotary.rotary_dim).T.reshape(x.shape)

    cos, sin = GlmRotaryEmbedding(config)(q, positions[None])
    expected_q, expected_k = (x[0].transpose(0, 1) for x in apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin))  # fmt: skip
    with ops.use(CpuOps()):
        got_q, got_k = rotary(positions, reordered(q), reordered(k))
    torch.testing.assert_close(got_q, reordered(expected_q))
    torch.testing.assert_close(got_k, reordered(expected_k))
    scores = torch.einsum("thd,shd->hts", got_q, got_k)
    torch.testing.assert_close(scores, torch.einsum("thd,shd->hts", expected_q, expected_k))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm")
    hf = save_tiny_model(glm_config(), folder)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


@pytest.mark.parametrize("length", (3, 17, 61))
def test_prefill_logits_match_hf(models, length):
    hf, llm = models
    tokens = prompt(length)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    error = (got - expected).abs().max() / expected.abs().max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e}"


def test_greedy_tokens_match_hf_generate(models):
    hf, llm = models
    tokens = prompt(17, seed=1)
    expected = hf.generate(torch.tensor([tokens]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected[0, len(tokens) :].tolist()
