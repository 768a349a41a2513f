"""Many streams at once, and clients that leave mid-answer."""

from __future__ import annotations

import asyncio
import time

import httpx

PROMPTS = ["Name a color.", "Count to five.", "What is 2 + 2?", "Say something about the sea."]


def wait_for(predicate, timeout: float, interval: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def test_16_concurrent_streams_complete_with_the_same_text_as_alone(server, client, model):
    requests = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(16)]
    alone = {
        i: client.chat.completions.create(model=model, messages=m, temperature=0, max_tokens=12).choices[0]
        for i, m in enumerate(requests[: len(PROMPTS)])
    }

    async def stream(messages):
        async with server.async_client(timeout=300) as aclient:
            chunks = [
                c
                async for c in await aclient.chat.completions.create(
                    model=model, messages=messages, temperature=0, max_tokens=12, stream=True
                )
            ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        return text, chunks[-1].choices[0].finish_reason

    async def all_streams():
        return await asyncio.gather(*(stream(m) for m in requests))

    results = asyncio.run(all_streams())
    for i, (text, finish_reason) in enumerate(results):
        reference = alone[i % len(PROMPTS)]
        assert text == reference.message.content, (i, text, reference.message.content)
        assert finish_reason == reference.finish_reason


def kv_is_free(server) -> bool:
    metrics = server.metrics()
    return metrics["xinfer_kv_cache_usage"] == 0 and metrics["xinfer_num_requests_running"] == 0


def test_dropped_streams_free_their_kv_blocks(server, client, model):
    async def open_and_drop(i: int):
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Tell a long story number {i}."}],
            "max_tokens": 900,
            "stream": True,
            "ignore_eos": True,
        }
        async with (
            httpx.AsyncClient(timeout=120, headers=server.headers) as http,
            http.stream("POST", server.url + "/v1/chat/completions", json=body) as response,
        ):
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen >= 3:
                    return True  # leaving the block closes the connection mid-stream

    async def run():
        return await asyncio.gather(*(open_and_drop(i) for i in range(20)))

    assert all(asyncio.run(run()))
    assert wait_for(lambda: kv_is_free(server), timeout=30), server.metrics()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert reply.choices[0].message.content
    assert server.metrics()['xinfer_requests_finished_total{finish_reason="abort"}'] >= 20


def test_dropped_non_streaming_request_is_aborted(server, model):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write an essay."}],
        "max_tokens": 900,
        "ignore_eos": True,
    }
    try:
        server.post("/v1/chat/completions", body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    else:
        raise AssertionError("900 tokens should take longer than 1.5 s here")
    assert wait_for(lambda: kv_is_free(server), timeout=30), server.metrics()
