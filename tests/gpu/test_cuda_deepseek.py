"""End to end on the GPU: multi-head latent attention through the CUDA backend's kernels (``mla_rows`` storing
the rows, decode with the values up-projected in its merge at small batches, prefill, CUDA graphs) gives the
CPU backend's tokens, which test_deepseek.py checks against transformers. Runs on the GPU machine."""

import pytest
import torch

from tests.plugins.deepseek.configs import deepseek_v2_config, deepseek_v3_config
from tests.plugins.hf_parity import randomize, spread_routing
from tests.tiny_models import prompt, save_tiny_model
from xinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; benchmarks/gpu_suite.py runs it on the GPU machine"
)

CONFIGS = {"deepseek-v3": deepseek_v3_config, "deepseek-v2": deepseek_v2_config}  # q-LoRA, and without
# prompts of one token to past the rows' launch's absorbing limit (16 tokens), 12 of them
PROMPTS = [prompt(n, seed=n) for n in (1, 5, 17, 40, 63, 100, 3, 9, 30, 2, 12, 50)]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def model_dir(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(CONFIGS[request.param](), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# decode steps of at most 4 sequences (values up-projected in the merge), and of up to 12 (after attention)
@pytest.mark.parametrize("max_num_seqs", [4, 16])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gpu_greedy_tokens_equal_cpu_backend(model_dir, enforce_eager, max_num_seqs):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", num_blocks=128)
    gpu = LLM(
        model=model_dir,
        dtype="float32",
        device="cuda",
        num_blocks=128,
        max_num_seqs=max_num_seqs,
        enforce_eager=enforce_eager,
    )
    assert tokens(gpu, PROMPTS, params) == tokens(cpu, PROMPTS, params)
