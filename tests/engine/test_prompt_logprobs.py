"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``, and ``echo`` with ``logprobs`` on the server)
against transformers' log-softmax of its logits at each position (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.engine import runner


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(**COMMON, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    hf = save_tiny_model(config, folder)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)


def expected_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("length", [1, 9, 40])
def test_each_prompt_token_scored_after_the_ones_before_it(models, length, monkeypatch):
    monkeypatch.setattr(runner, "LOGPROB_ROWS", 16)  # the 40-token prompt's logits in three pieces
    hf, llm = models
    tokens = prompt(length, seed=3)
    out = llm.generate([tokens], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    expected = expected_logprobs(hf, tokens)
    assert len(out.prompt_logprobs) == length and out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = tokens[position]
        assert entry[token] == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
        top = expected[position - 1].topk(3)
        for alternative, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[alternative] == pytest.approx(value, abs=1e-4)
        assert set(entry) <= {token, *top.indices.tolist()}


def test_without_alternatives_only_the_prompt_token_and_none_unasked(models):
    _, llm = models
    tokens = prompt(12, seed=4)
    asked, unasked = llm.generate(
        [tokens, tokens], [SamplingParams(max_tokens=1, prompt_logprobs=0), SamplingParams(max_tokens=1)]
    )
    assert [list(entry) for entry in asked.prompt_logprobs[1:]] == [[t] for t in tokens[1:]]
    assert unasked.prompt_logprobs is None


def test_negative_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0, or -1 for the whole vocabulary, got -2"):
        SamplingParams(prompt_logprobs=-2)


def test_minus_one_asks_for_every_token_of_the_vocabulary(models):
    """vLLM's ``logprobs=-1`` / ``prompt_logprobs=-1``: every token's log-probability, each ranked."""
    hf, llm = models
    tokens = prompt(5, seed=7)
    out = llm.generate([tokens], SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1), use_tqdm=False)[0]
    expected = expected_logprobs(hf, tokens + out.outputs[0].token_ids)
    vocab = COMMON["vocab_size"]
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert [len(entry) for entry in entries] == [vocab] * (len(tokens) + 1)
    for position, entry in enumerate(entries):
        assert sorted(lp.rank for lp in entry.values()) == list(range(1, vocab + 1))
        assert [entry[t] for t in range(vocab)] == pytest.approx(expected[position].tolist(), abs=1e-4)


def test_vllm_keywords_and_the_cumulative_logprob(models, capsys):
    """vLLM's spelling of the offline API: ``sampling_params=``, ``use_tqdm``, ``get_tokenizer()``, and each
    choice's ``cumulative_logprob``, the sum of its tokens' log-probabilities (``None`` unasked)."""
    hf, llm = models
    tokens = prompt(7, seed=5)
    out = llm.generate([tokens], sampling_params=SamplingParams(temperature=0, max_tokens=3, logprobs=0))[0]
    choice = out.outputs[0]
    expected, step = 0.0, list(tokens)
    for token in choice.token_ids:  # transformers' log-softmax after each prefix
        expected += expected_logprobs(hf, step)[-1, token].item()
        step.append(token)
    assert choice.cumulative_logprob == pytest.approx(expected, abs=1e-4)
    assert "Generating" in capsys.readouterr().err  # vLLM's default: a progress bar
    quiet = llm.generate([tokens], sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert quiet.outputs[0].cumulative_logprob is None
    assert "Generating" not in capsys.readouterr().err
    assert llm.get_tokenizer() is llm.tokenizer


def test_entries_read_as_vllm_logprobs_ranked_in_the_whole_vocabulary(models):
    """Each entry is a float that also reads as vLLM's ``Logprob``: ``.logprob`` and ``.rank``, the count of the
    vocabulary's tokens at least as likely there (transformers' log-softmax), for prompt and sampled tokens alike;
    without a tokenizer ``.decoded_token`` is None."""
    hf, llm = models
    tokens = prompt(9, seed=6)
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=6, logprobs=2, prompt_logprobs=2)
    out = llm.generate([tokens], params, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    expected = expected_logprobs(hf, tokens + generated)
    entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
    assert len(entries) == len(tokens) - 1 + len(generated)
    ranks_of_chosen = []
    for position, (token, entry) in enumerate(zip(tokens[1:] + generated, entries)):
        row = expected[position]
        for candidate, logprob in entry.items():
            assert isinstance(logprob, float) and logprob.logprob == float(logprob)
            assert logprob.logprob == pytest.approx(row[candidate].item(), abs=1e-4)
            assert logprob.rank == int((row >= row[candidate]).sum()), (position, candidate)
            assert logprob.decoded_token is None
        ranks_of_chosen.append(entry[token].rank)
        assert {1, 2} <= {logprob.rank for logprob in entry.values()}  # the two likeliest
    assert max(ranks_of_chosen) > 2  # a temperature of 1.5 over random weights draws tokens below the top two
