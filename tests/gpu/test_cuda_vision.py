"""Gemma 3 with images on the GPU: the cuda backend (image steps eager, the attention of image tokens that
see each other through the torch reference, decode steps replayed from graphs) gives the CPU backend's
tokens. Runs on the GPU machine (benchmarks/gpu_suite.py)."""

import pytest
import torch

from tests.plugins.gemma.gemma3_vision_model import image, save_model
from xinfer import LLM, SamplingParams
from xinfer.torch_ops import TorchOps
from xinfer_cuda.ops import CudaOps

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; benchmarks/gpu_suite.py runs it on the GPU machine"
)
TEXT = "look at <start_of_image> and tell me what you see"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-vision-gpu")
    save_model(path, initializer_range=0.2)  # wide logits: CPU and GPU summation orders do not flip a near-tie
    return str(path)


def tokens(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_gemma3_vision_gives_cpu_tokens(folder, enforce_eager):
    prompts = [{"prompt": TEXT, "multi_modal_data": {"image": image(seed)}} for seed in (1, 2, 1)]
    prompts.append({"prompt": "look at this and that"})
    cpu = LLM(model=folder, dtype="float32", device="cpu", num_blocks=64)
    gpu = LLM(model=folder, dtype="float32", device="cuda", num_blocks=64, max_num_seqs=8,
              enforce_eager=enforce_eager, max_num_batched_tokens=12)  # fmt: skip
    assert tokens(gpu, prompts) == tokens(cpu, prompts)
    assert gpu.engine.encoder_cache.misses == 2  # two distinct images


def test_encoder_attention_matches_the_reference_in_bf16():
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(300, 16, 72, device="cuda", generator=generator, dtype=torch.bfloat16) for _ in range(3))
    cu_seqlens = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    got = CudaOps().encoder_attention(q, k, v, cu_seqlens, 72**-0.5)
    expected = TorchOps().encoder_attention(q.float(), k.float(), v.float(), cu_seqlens, 72**-0.5)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
