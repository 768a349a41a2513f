"""A prefill server (``--pd-server``) and a decode client (``--pd-client``) on 127.0.0.1, the cache
moved over gloo: the client's greedy tokens are one server's, the prefill server counts the prompts,
its prefix-cache hits reach the client's usage, and a dead prefill server fails only the requests it
was prefilling (503) while the client keeps serving."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig

from tests.plugins.hf_parity import randomize
from tests.server.live import LiveServer, free_port
from tests.tiny_models import COMMON, gemma3_config, prompt, save_tiny_model

FLAGS = ("--cpu", "--dtype", "f32", "--kv-fraction", "0.01")


def _pair(folder):
    server = LiveServer("--m", str(folder), *FLAGS, "--pd-server", name="pd-server").start()
    try:
        client = LiveServer("--m", str(folder), *FLAGS, "--pd-client", "--pd-url", server.url, name="pd-client").start()
    except BaseException:
        server.stop()
        raise
    return server, client


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    config = LlamaConfig(**COMMON) if request.param == "llama" else gemma3_config()  # gemma3: sliding-window blocks
    hf = save_tiny_model(config, folder)
    randomize(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(COMMON["vocab_size"])}, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    (folder / "tokenizer.json").write_text(tokenizer.to_str())  # so that answers carry their tokens
    server, client = _pair(folder)
    yield server, client, folder
    client.stop()
    server.stop()


def _complete(live: LiveServer, token_ids: list[int], max_tokens: int = 8):
    openai_client = live.client()
    model = openai_client.models.list().data[0].id
    return openai_client.completions.create(
        model=model, prompt=[token_ids], max_tokens=max_tokens, temperature=0, logprobs=1
    )


def test_the_client_decodes_the_tokens_one_server_gives(pair):
    server, client, _ = pair
    prompts = [prompt(45, seed=3), prompt(70, seed=4), prompt(5, seed=5)]  # past the window; shorter than a block
    prompt_tokens = server.metrics()["xinfer_prompt_tokens_total"]
    hits = client.metrics()["xinfer_prefix_cache_hits_total"]
    got = [_complete(client, p) for p in prompts]
    assert server.metrics()["xinfer_prompt_tokens_total"] - prompt_tokens == sum(map(len, prompts))
    assert client.metrics()["xinfer_prefix_cache_hits_total"] > hits  # the long prompts' blocks came from the server
    expected = [_complete(server, p) for p in prompts]
    for a, b in zip(expected, got):
        assert len(a.choices[0].logprobs.tokens) == 8
        assert b.choices[0].logprobs.tokens == a.choices[0].logprobs.tokens
        assert b.choices[0].logprobs.token_logprobs == pytest.approx(a.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_prefix_cache_hits_of_the_prefill_server_are_reported(pair):
    _, client, _ = pair
    tokens = prompt(50, seed=7)
    first, again = _complete(client, tokens, 2), _complete(client, tokens, 2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # the full blocks the server kept


@pytest.mark.parametrize("pair", ["llama"], indirect=True)  # the fallback does not depend on the model
def test_with_fallback_local_an_unreachable_prefill_server_means_prefilling_here(pair):
    server, _, folder = pair
    nowhere = f"http://127.0.0.1:{free_port()}"
    flags = ("--m", str(folder), *FLAGS, "--pd-client", "--pd-url", nowhere, "--pd-fallback", "local")
    client = LiveServer(*flags, name="pd-fallback").start()
    try:
        tokens = prompt(40, seed=30)
        got = _complete(client, tokens)
        log = client.log_path.read_text()
        assert f"the prefill server {nowhere} is unreachable" in log and "prefilling here" in log
    finally:
        client.stop()
    assert got.choices[0].logprobs.tokens == _complete(server, tokens).choices[0].logprobs.tokens


def test_a_dead_prefill_server_fails_its_requests_and_the_client_keeps_serving(pair):
    server, client, _ = pair
    prompts = [prompt(40 + i, seed=20 + i) for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_complete, client, p, 4) for p in prompts]
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        for future in futures:
            try:
                assert future.result().choices[0].finish_reason == "length"
            except openai.APIStatusError as error:
                assert error.status_code == 503 and "prefill server" in error.message
    with pytest.raises(openai.APIStatusError) as failed:
        _complete(client, prompt(30, seed=40))
    assert failed.value.status_code == 503 and "prefill server" in failed.value.message
    assert httpx.get(client.url + "/health", timeout=10).status_code == 200
