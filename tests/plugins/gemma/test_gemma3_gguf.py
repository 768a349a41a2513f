"""The real Gemma-3-270M (Q4_K_M GGUF) through xinfer against transformers' GGUF loading
of the same file (fp32, CPU): same dequantized weights (packed, on the reference path), so logits agree to
fp32 rounding."""

import pytest
import torch

from tests.loading.gguf_models import GEMMA, gguf_path, hf_model, reference_llm
from tests.tiny_models import prefill_logits
from xinfer import SamplingParams
from xinfer.text.tokenizer import Tokenizer

# longer than nothing, shorter than the 512-token window: the window itself is checked
# by the tiny-model tests; here the real weights, norms and rope bases are
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def gemma():
    path = gguf_path(GEMMA)
    tokenizer = Tokenizer.from_gguf(path)
    llm = reference_llm(GEMMA, dtype="float32", num_blocks=32, max_model_len=512, tokenizer=tokenizer)
    return llm, tokenizer


def test_prefill_logits_match_transformers(gemma):
    llm, tokenizer = gemma
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        expected = hf_model(GEMMA)(torch.tensor([ids])).logits[0]
    got = prefill_logits(llm.engine, ids)
    error = ((got - expected).abs().max(-1).values / expected.abs().max(-1).values).max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e} (worst position)"


def test_greedy_continuation_matches_transformers(gemma):
    llm, tokenizer = gemma
    ids = tokenizer.encode(PROMPT)
    expected = (
        hf_model(GEMMA)
        .generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids) :]
        .tolist()
    )
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == expected
    assert out.text == tokenizer.decode(expected)
