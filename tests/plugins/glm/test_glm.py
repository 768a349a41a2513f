"""GlmForCausalLM (GLM-4-9B-hf) against transformers' modeling code (fp32, CPU): rotary over adjacent
pairs of each head's first half, q/k/v biases, Llama's two norms per layer."""

import pytest

from tests.plugins.glm.configs import glm_config
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match, randomize
from tests.tiny_models import save_tiny_model
from xinfer import LLM


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("glm")
    hf = save_tiny_model(glm_config(), folder)
    randomize(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


@pytest.mark.parametrize("length", (3, 17, 61))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_tokens_and_logprobs_match_hf(models, length):
    assert_greedy_tokens_and_logprobs_match(*models, length)
