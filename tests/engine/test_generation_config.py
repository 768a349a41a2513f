"""Sampling defaults from the checkpoint's ``generation_config.json``, as vLLM applies them (its
``--generation-config auto``): a request that sets no sampling takes the model authors' temperature, top_k,
top_p, min_p, repetition_penalty and max_new_tokens; flags, and a request's own values, win. Top-k 1 makes the
recommendation visible in the tokens: every draw is the likeliest token."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import pytest
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.server.args import parse_args
from xinfer.server.launch import sampling_defaults

RECOMMENDED = {"do_sample": True, "top_k": 1, "top_p": 0.9, "repetition_penalty": 1.1, "max_new_tokens": 5}
PROMPT = prompt(12)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("recommended")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    (folder / "generation_config.json").write_text(json.dumps(RECOMMENDED))
    return folder


@pytest.fixture(scope="module")
def llm(folder):
    return LLM(str(folder), num_blocks=32)


def test_generate_without_params_samples_as_the_model_recommends(llm):
    default = llm.get_default_sampling_params()
    assert (default.top_k, default.top_p, default.repetition_penalty, default.max_tokens) == (1, 0.9, 1.1, 5)
    assert default.temperature == SamplingParams().temperature  # the file sets none
    greedy = SamplingParams(temperature=0, repetition_penalty=1.1, max_tokens=5)
    expected = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for seed in range(3):  # top-k 1: the draw is the likeliest token whatever the noise
        params = llm.get_default_sampling_params()
        params.seed = seed
        assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert llm.generate([PROMPT], use_tqdm=False)[0].outputs[0].token_ids == expected
    assert len(llm.generate([PROMPT], SamplingParams(), use_tqdm=False)[0].outputs[0].token_ids) == 16


def test_none_keeps_the_sampling_params_defaults(folder):
    llm = LLM(str(folder), num_blocks=32, generation_config="none")
    assert llm.get_default_sampling_params() == SamplingParams()


def test_a_generation_config_elsewhere_and_a_bad_one(folder, tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1, "top_p": 0.5}))
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        llm = LLM(str(folder), num_blocks=32, generation_config=str(tmp_path))
    assert llm.recommended_sampling == {"top_p": 0.5}  # the negative temperature is left out, saying so
    assert "temperature -1 left out: temperature must be >= 0" in caplog.text
    with pytest.raises(ValueError, match="generation_config '/no/such/folder': not a folder"):
        LLM(str(folder), generation_config="/no/such/folder")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"the folder holds no generation_config\.json"):
        LLM(str(folder), generation_config=str(empty))
    (tmp_path / "generation_config.json").write_text("{not json")  # named, so it must be read: an error
    with pytest.raises(ValueError, match=r"generation_config\.json is not JSON"):
        LLM(str(folder), num_blocks=32, generation_config=str(tmp_path))


def test_the_server_takes_the_recommendation_under_its_flags(folder):
    recommended = sampling_defaults(parse_args(["--m", str(folder), "--top-p", "0.5"]), folder)
    assert asdict(recommended) == {
        "temperature": 1.0, "top_k": 1, "top_p": 0.5, "min_p": 0.0, "repetition_penalty": 1.1,
        "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": None, "max_tokens": None,
        "recommended_max_tokens": 5,
    }  # fmt: skip
    # max_new_tokens is the limit of a request that sets none, and as vLLM's get_max_tokens takes it, a cap on
    # what a request or a route's default (OpenAI's 16 on /v1/completions) asks for; within the context's room
    limits = [recommended.token_limit(*args) for args in ((None, None, 100), (None, 16, 100), (50, None, 100),
                                                          (2, None, 100), (None, None, 3))]  # fmt: skip
    assert limits == [5, 5, 5, 2, 3]
    flagged = sampling_defaults(parse_args(["--m", str(folder), "--max-tokens", "40"]), folder)  # the flag wins
    assert (flagged.token_limit(None, None, 100), flagged.token_limit(None, 16, 100)) == (40, 40)
    assert flagged.token_limit(60, None, 100) == 60
    plain = sampling_defaults(parse_args(["--m", str(folder), "--generation-config", "none"]), folder)
    assert plain == type(plain)()
