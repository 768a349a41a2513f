"""GlmForCausalLM (GLM-4-9B-hf: Llama's two norms per layer) and Glm4ForCausalLM (GLM-4-0414: four
norms per layer) against transformers' modeling code (fp32, CPU): rotary over adjacent pairs of each
head's first half, q/k/v biases."""

import pytest

from tests.plugins.glm.configs import glm4_config, glm_config
from tests.plugins.hf_parity import assert_greedy_tokens_and_logprobs_match, assert_prefill_logits_match, randomize
from tests.tiny_models import save_tiny_model
from xinfer import LLM


@pytest.fixture(scope="module", params=[glm_config, glm4_config], ids=["glm", "glm4"])
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param.__name__)
    hf = save_tiny_model(request.param(), folder)
    randomize(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


@pytest.mark.parametrize("length", (3, 17, 61))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)


@pytest.mark.parametrize("length", (5, 40))
def test_greedy_tokens_and_logprobs_match_hf(models, length):
    assert_greedy_tokens_and_logprobs_match(*models, length)
