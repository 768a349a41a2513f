"""vLLM's offline ``LLM.generate`` semantics on a tiny Llama: the text of a stop token, refused requests,
and ``detokenize``. Expected texts come from the tokenizer's own decode of the generated ids."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams

VOCAB = COMMON["vocab_size"]
PROMPT = prompt(20, seed=5)


class LetterTokenizer:
    """Token ``i`` reads as one letter; ``eos_token_ids`` as given."""

    def __init__(self, eos_token_ids: tuple[int, ...] = ()):
        self.eos_token_ids = eos_token_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    return str(folder)


def make_llm(model_dir: str, eos_token_ids: tuple[int, ...] = ()) -> LLM:
    return LLM(model=model_dir, tokenizer=LetterTokenizer(eos_token_ids), dtype="float32", num_blocks=64)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return make_llm(model_dir)


def greedy(llm: LLM, **options) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **options)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_stop_token_id_ends_the_choice_without_its_text_unless_asked(llm):
    """vLLM: a stop token id is in ``token_ids`` and is the ``stop_reason``; its text is left out of ``text``
    unless ``include_stop_str_in_output``."""
    free = greedy(llm)
    stop = free[2]
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[:3]
    assert (out.text, out.finish_reason, out.stop_reason) == (LetterTokenizer().decode(free[:2]), "stop", stop)
    assert "".join(delta.outputs[0].text for delta in llm.stream([PROMPT], params)) == out.text
    kept = llm.generate([PROMPT], replace(params, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert (kept.token_ids, kept.text) == (free[:3], LetterTokenizer().decode(free[:3]))


def test_eos_decoded_with_special_tokens_is_left_out_of_the_text(model_dir, llm):
    """vLLM: EOS ends a choice with ``stop_reason`` None and, even with ``skip_special_tokens=False``, without
    its text; with ``ignore_eos`` it is an ordinary token."""
    free = greedy(llm)
    with_eos = make_llm(model_dir, eos_token_ids=(free[3],))
    params = SamplingParams(temperature=0, max_tokens=8, skip_special_tokens=False)
    out = with_eos.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == (free[:4], "stop", None)
    assert out.text == LetterTokenizer().decode(free[:3])
    ignored = with_eos.generate([PROMPT], replace(params, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert ignored.text == LetterTokenizer().decode(free)


class LetterTokenizerWithEos(LetterTokenizer):
    def __init__(self, eos_token_id: int):
        super().__init__((eos_token_id,))
        self.eos_token_id = eos_token_id


@pytest.mark.parametrize("tokenizers_eos", [True, False])
def test_the_stop_reason_of_a_generation_config_eos_is_its_id_but_for_the_tokenizers(tmp_path, llm, tokenizers_eos):
    """vLLM (SamplingParams.update_from_generation_config): the tokenizer's EOS ends a choice with stop_reason None;
    the other EOS ids of generation_config.json are stop token ids, each the stop_reason of the choice it ends."""
    free = greedy(llm)
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    (tmp_path / "generation_config.json").write_text(f'{{"eos_token_id": [{free[3]}, {VOCAB - 1}]}}')
    tokenizer = LetterTokenizerWithEos(free[3] if tokenizers_eos else VOCAB - 1)
    with_eos = LLM(model=str(tmp_path), tokenizer=tokenizer, dtype="float32", num_blocks=64)
    out = with_eos.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free[:4], "stop")
    assert out.stop_reason == (None if tokenizers_eos else free[3])
    assert out.text == LetterTokenizer().decode(free[:3])


class PairTokenizer(LetterTokenizer):
    """Token ``i`` reads as two letters: one token can complete two stop strings ending at different places."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) + chr(ord("a") + (i + 7) % 26) for i in ids)


@pytest.mark.parametrize("stops, include, text, stop_reason", [
    ((slice(2, 4), slice(0, 4)), False, slice(0, 2), slice(2, 4)),  # both end at the 4th letter: the first listed
    ((slice(0, 4), slice(2, 4)), False, slice(0, 0), slice(0, 4)),
    ((slice(1, 4), slice(2, 3)), False, slice(0, 1), slice(1, 4)),  # the first listed, though the other ends first
    ((slice(1, 4), slice(2, 3)), True, slice(0, 4), slice(1, 4)),
    ((slice(2, 3), slice(1, 4)), True, slice(0, 3), slice(2, 3)),
])  # fmt: skip
def test_of_the_stop_strings_a_step_completes_the_first_listed_wins(model_dir, stops, include, text, stop_reason):
    """vLLM's check_stop_strings: the first listed of those the new text completes. xinfer took the one ending
    first (a "\n\n" token with stop=["\n\n", "\n"] stopped at "\n"), before that the one starting first."""
    llm = LLM(model=model_dir, tokenizer=PairTokenizer(), dtype="float32", num_blocks=64)
    letters = PairTokenizer().decode(greedy(llm))
    assert len(set(letters[:4])) == 4, letters  # (no stop string occurs before the place meant)
    params = SamplingParams(temperature=0, max_tokens=8, stop=[letters[s] for s in stops],
                            include_stop_str_in_output=include)  # fmt: skip
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.stop_reason) == (letters[text], letters[stop_reason])


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_more_alternatives_than_the_vocabulary_is_refused_and_the_engine_serves_on(llm, field):
    with pytest.raises(ValueError, match=f"{field} must be at most the vocabulary's {VOCAB} tokens, got 1000"):
        llm.generate([PROMPT], SamplingParams(max_tokens=2, **{field: 1000}), use_tqdm=False)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=2, **{field: VOCAB}), use_tqdm=False)[0]
    entries = out.outputs[0].logprobs if field == "logprobs" else out.prompt_logprobs[1:]
    assert entries and all(len(entry) == VOCAB for entry in entries)
    assert all(pool.num_free_blocks == pool.num_blocks for pool in llm.engine.cache.pools)


def test_a_negative_stop_token_id_is_refused():
    # it would index the logits from the end: another row's last token masked under min_tokens
    with pytest.raises(ValueError, match=r"stop_token_ids must be >= 0, got \[-1\]"):
        SamplingParams(stop_token_ids=[-1], min_tokens=2)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    """vLLM's ``detokenize=False``: token ids only; stop strings, which match the text, are refused."""
    assert greedy(llm, detokenize=False, spaces_between_special_tokens=False) == greedy(llm)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["ab"])


def test_logprobs_decoded_token_is_each_tokens_own_text_unless_not_detokenized(llm):
    """vLLM's ``Logprob.decoded_token``: the token decoded alone (sampled, alternatives and prompt tokens); ``None``
    with ``detokenize=False``. Entries keep their fields through pickling (tensor-parallel and PD hand them on)."""
    letter = LetterTokenizer().decode
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    entries = out.outputs[0].logprobs + out.prompt_logprobs[1:]
    assert all(lp.decoded_token == letter([t]) for entry in entries for t, lp in entry.items())
    assert [entry[t].rank for t, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)] == [1] * 4  # greedy
    copy = pickle.loads(pickle.dumps(entries[0]))
    assert {t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in copy.items()} == {
        t: (float(lp), lp.rank, lp.decoded_token) for t, lp in entries[0].items()
    }
    bare = llm.generate([PROMPT], replace(params, detokenize=False), use_tqdm=False)[0]
    assert all(lp.decoded_token is None for entry in bare.outputs[0].logprobs for lp in entry.values())
