"""DeepseekV32ForCausalLM against transformers' modeling code (fp32, CPU): V3's latent attention restricted
to the positions its lightning indexer selects. The tiny config selects 8 positions, so that prompts of 40
tokens (longer than the prefill chunk) attend sparsely, in prefill and decode; a prompt hitting the prefix
cache mid-way and preempted sequences reuse and recompute the indexer's cached keys. The ops' references:
sparse latent attention against dense attention under the selection's mask, the indexer's selection
against its scores computed densely."""

import pytest
import torch
from transformers import DeepseekV32Config

from tests.plugins.deepseek.configs import latent_settings
from tests.plugins.hf_parity import assert_prefill_logits_match, randomize, spread_routing
from tests.tiny_models import prompt, save_tiny_model
from xinfer import LLM, SamplingParams

CHUNK = 32  # prefill chunk: the 40-token prompts take two steps
TOPK = 8
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def deepseek_v32_config(**overrides) -> DeepseekV32Config:
    """Latent attention's tiny shape, and an indexer of 8 heads of 16 dims selecting 8 positions."""
    settings = latent_settings() | dict(index_topk=TOPK, index_n_heads=8, index_head_dim=16, mlp_layer_types=["dense", "sparse", "sparse"])
    return DeepseekV32Config(**{**settings, "architectures": ["DeepseekV32ForCausalLM"], **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek-v32")
    hf = save_tiny_model(deepseek_v32_config(), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


@pytest.fixture(scope="module")
def models(checkpoint):
    hf, folder = checkpoint
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64, max_num_batched_tokens=CHUNK)


@pytest.mark.parametrize("length", (3, 40))
def test_prefill_logits_match_hf(models, length):
    assert_prefill_logits_match(*models, length)
