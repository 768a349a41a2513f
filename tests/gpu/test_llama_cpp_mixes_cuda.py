"""llama.cpp's own K-quant mixes (tests/quant/test_llama_cpp_mixes.py) on the GPU: the CUDA backend's packed-weight
kernels (planes where the type has them, the file's blocks for Q2_K, Q3_K and Q5_K) give the CPU reference path's
logits and greedy tokens, fp32 on both. Runs on the GPU machine."""

import pytest
import torch

from tests.loading.gguf_models import reference_llm
from tests.quant.test_llama_cpp_mixes import CONFIG, f32_ggufs, quantized_file  # noqa: F401 (fixtures)
from tests.tiny_models import prefill_logits, prompt
from xinfer import LLM, SamplingParams

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; benchmarks/gpu_suite.py runs it on the GPU machine"
)


def test_cuda_gives_the_reference_logits_and_tokens_of_llama_cpps_file(quantized_file):  # noqa: F811
    mix, path = quantized_file
    gpu = LLM(model=str(path), dtype="float32", device="cuda", num_blocks=64, max_num_seqs=4, enforce_eager=True)
    cpu = reference_llm(path, dtype="float32", device="cpu", num_blocks=64)
    prompts = [prompt(n, vocab_size=CONFIG["vocab_size"], seed=n) for n in (1, 29, 70)]
    for ids in prompts:
        got, expected = prefill_logits(gpu.engine, ids).cpu(), prefill_logits(cpu.engine, ids)
        error = float(((got - expected).abs().max(-1).values / expected.abs().max(-1).values).max())
        assert error <= 1e-4, f"{mix}, {len(ids)} tokens: max|diff|/max|logit| = {error:.2e}"
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params)] for llm in (gpu, cpu)]
    assert tokens[0] == tokens[1], mix
