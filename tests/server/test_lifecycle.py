"""A server of its own: flags from the environment, the bounded queue (429), SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from openai.types.chat import ChatCompletionChunk
from transformers import LlamaConfig

from tests.server.live import REPO, LiveServer

# Long enough for in-flight streams to end even on a CPU shared with other jobs, where a
# step of this model has taken seconds: the drain test must not depend on the machine's speed.
SHUTDOWN_TIMEOUT_S = 300
ENV = {"XINFER_MAX_MODEL_LEN": "512", "XINFER_PORT": "1", "XINFER_DISABLE_PREFIX_CACHE": "true"}


@pytest.fixture(scope="module")
def small_server():
    live = LiveServer(
        "--max-num-seqs",
        "2",
        "--max-waiting",
        "2",
        "--shutdown-timeout",
        str(SHUTDOWN_TIMEOUT_S),
        env=ENV,
        name="small-server",
    ).start()
    yield live
    live.stop()


def long_chat(max_tokens: int, content: str = "Tell me a story.") -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": True}


def test_flags_come_from_the_environment_and_the_command_line_wins(small_server):
    model = httpx.get(small_server.url + "/v1/models").json()["data"][0]
    assert model["max_model_len"] == 512  # XINFER_MAX_MODEL_LEN; XINFER_PORT lost to --port
    small_server.post("/v1/completions", {"prompt": "Hi " * 40, "max_tokens": 1})
    again = small_server.post("/v1/completions", {"prompt": "Hi " * 40, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # XINFER_DISABLE_PREFIX_CACHE


def test_full_queue_answers_429_with_retry_after(small_server):
    async def burst():
        async with httpx.AsyncClient(timeout=300) as http:
            calls = [
                http.post(small_server.url + "/v1/chat/completions", json=long_chat(48, f"Story {i}."))
                for i in range(8)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 429 in statuses, statuses
    assert set(statuses) <= {200, 429}
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "queue_full"
    assert httpx.post(small_server.url + "/v1/chat/completions", json=long_chat(2), timeout=120).status_code == 200


def read_stream(url: str, body: dict, into: dict, started: threading.Event) -> None:
    events = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    into["events"] = events


def start_streams(server: LiveServer, *max_tokens: int) -> tuple[list[threading.Thread], list[dict]]:
    """Streams one chat per entry; returns once each has its first event."""
    url = server.url + "/v1/chat/completions"
    results = [{} for _ in max_tokens]
    started = [threading.Event() for _ in max_tokens]
    readers = [
        threading.Thread(target=read_stream, args=(url, long_chat(n), result, event))
        for n, result, event in zip(max_tokens, results, started)
    ]
    for reader in readers:
        reader.start()
    assert all(event.wait(120) for event in started)
    return readers, results


def assert_ended(result: dict, finish_reason: str) -> None:
    events = result["events"]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == finish_reason and reasons.count(finish_reason) == 1


def test_sigterm_finishes_streams_in_flight_then_exits_0(small_server):
    # 32 and 64 tokens: still running when SIGTERM comes, a step being milliseconds at best
    readers, results = start_streams(small_server, 64, 32)
    small_server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.HTTPError):  # no new connections while draining
        httpx.get(small_server.url + "/health", timeout=5).raise_for_status()
    for reader in readers:
        reader.join(SHUTDOWN_TIMEOUT_S + 60)
    assert small_server.proc.wait(60) == 0
    for result in results:
        assert_ended(result, "length")


def test_sigterm_aborts_what_the_timeout_cuts_off_then_exits_0():
    """A stream cut off at shutdown ends with OpenAI's error event (a 503's), not a finish reason: the official
    client's types know none for it (``abort`` was sent)."""
    # 450 tokens cannot finish inside half a second: that takes over 1 ms a step
    server = LiveServer("--shutdown-timeout", "0.5", env=ENV, name="sigterm-timeout-server").start()
    try:
        readers, results = start_streams(server, 450)
        server.proc.send_signal(signal.SIGTERM)
        readers[0].join(120)
        assert server.proc.wait(60) == 0
        *chunks, error, done = [json.loads(e) if e != "[DONE]" else e for e in results[0]["events"]]
        assert done == "[DONE]" and error["error"]["type"] == "service_unavailable_error"
        assert "shutting down" in error["error"]["message"]
        assert all(ChatCompletionChunk.model_validate(chunk).choices[0].finish_reason is None for chunk in chunks)
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_signal_while_the_model_loads_ends_the_server_at_once(sig, tmp_path):
    """Nothing is in flight while the model loads, and a load cannot be cut short: the server ends at once
    (128 + the signal), saying so in one line, instead of finishing the load first (it did, then exited 0)."""
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
                         num_attention_heads=8, num_key_value_heads=8, architectures=["LlamaForCausalLM"])  # fmt: skip
    config.save_pretrained(tmp_path)  # ~330M parameters of random weights: seconds to make on a CPU
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "xinfer.server", "--m", str(tmp_path), "--load-format", "dummy", "--cpu",
               "--port", "0"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while "serving the API" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        assert "model loaded" not in log.read_text()
        proc.send_signal(sig)
        assert proc.wait(30) == 128 + sig
        lines = log.read_text().splitlines()
        assert lines[-1] == "xinfer: interrupted while loading the model" and "model loaded" not in log.read_text()
    finally:
        proc.kill()
