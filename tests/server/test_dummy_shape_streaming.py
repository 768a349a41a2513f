"""A dummy-weight folder with the benchmarks' synthetic tokenizer streams one chunk per
generated token, so ``benchmarks/serve.py`` measures TTFT and ITL on model shapes that
have no real tokenizer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from transformers import LlamaConfig

from benchmarks.serve import Result, one_request
from benchmarks.shapes import save_synthetic_tokenizer
from tests.server.live import LiveServer

VOCAB = 320
OUTPUT_LEN = 12
PROMPT = [(37 * i + 11) % VOCAB for i in range(20)]


@pytest.fixture(scope="module")
def dummy_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dummy-shape")
    LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(folder)
    save_synthetic_tokenizer(folder, VOCAB)
    live = LiveServer(
        "--m", str(folder), "--load-format", "dummy", "--cpu", "--max-model-len", "256", name="dummy-shape"
    ).start()
    yield live
    live.stop()


def test_each_generated_token_streams_its_own_chunk_of_text(dummy_server):
    body = {"prompt": PROMPT, "max_tokens": OUTPUT_LEN, "ignore_eos": True, "temperature": 0, "stream": True}
    texts = []
    with httpx.stream("POST", dummy_server.url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    assert len(texts) == OUTPUT_LEN
    assert all(texts), texts
    assert len("".join(texts).split()) == OUTPUT_LEN  # one word t<id> per token


def test_serve_benchmark_measures_first_token_and_inter_token_latency(dummy_server):
    async def measure() -> Result:
        async with httpx.AsyncClient(base_url=dummy_server.url, timeout=120) as http:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            return await one_request(http, model, PROMPT, OUTPUT_LEN)

    result = asyncio.run(measure())
    assert result.ok, result.error
    assert result.output_tokens == result.chunks == OUTPUT_LEN
    assert len(result.itls) == OUTPUT_LEN - 1
    assert 0 < result.ttft < result.latency
