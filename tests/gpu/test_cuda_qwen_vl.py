"""Qwen3-VL end to end on the GPU: the cuda backend (Triton kernels, CUDA graphs for the decode
steps, whose positions the images shift) gives the CPU backend's tokens for prompts with images,
prefilled whole and in chunks that cut through them. Runs on the GPU machine
(benchmarks/gpu_suite.py)."""

import pytest
import torch
from transformers import Qwen3VLForConditionalGeneration

from tests.plugins.qwen.vl_fixtures import save_randomized, synthetic_image, text, tiny_vl_config, with_images
from xinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; benchmarks/gpu_suite.py runs it on the GPU machine"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-vl")
    config = tiny_vl_config(initializer_range=0.2)  # wide weights: logits far apart, no near-ties to flip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    save_randomized(Qwen3VLForConditionalGeneration(config).float().eval(), folder)
    return str(folder)


def prompts() -> list[dict]:
    images = [synthetic_image(40, 24, seed=1), synthetic_image(56, 16, seed=2), synthetic_image(32, 48, seed=3)]
    return [
        {"prompt_token_ids": with_images(text(5, 1), "image", text(7, 2)), "multi_modal_data": {"image": images[0]}},
        {"prompt_token_ids": with_images(text(3, 3), "image", text(4, 4), "image", text(2, 5)),
         "multi_modal_data": {"image": images[1:]}},
        {"prompt_token_ids": text(30, 6)},
    ]  # fmt: skip


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunked"])
def test_gpu_tokens_with_images_equal_cpu_backend(model_dir, enforce_eager, chunk):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    limits = {"max_num_batched_tokens": chunk} if chunk else {}
    cpu = LLM(model=model_dir, dtype="float32", device="cpu", num_blocks=128, **limits)
    gpu = LLM(model=model_dir, dtype="float32", device="cuda", num_blocks=128, max_num_seqs=8,
              enforce_eager=enforce_eager, **limits)  # fmt: skip
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts(), params)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts(), params)] == expected
