"""The engine front without a model: loading, a dead or stuck loop, and /health."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from xinfer.engine.async_engine import AsyncEngine, EngineUnavailable, TooManySequences
from xinfer.engine.engine import EngineStats, StepOutput
from xinfer.sampling import SamplingParams
from xinfer.server.app import build_app
from xinfer.server.metrics import Metrics
from xinfer.server.params import SamplingDefaults
from xinfer.server.serving import Serving


class ScriptedEngine:
    """Generates token 7 forever (text "a"); ``step_hook`` runs before each step."""

    max_model_len = 128

    def __init__(self, step_hook=lambda: None):
        self.step_hook = step_hook
        self.tokenizer = SimpleNamespace(
            encode=lambda text, add_special_tokens=True: [1, 2, 3],
            decode=lambda ids, skip_special_tokens=True: "a" * len(ids),
            chat_template=None,
        )
        self.hf_config = SimpleNamespace(vocab_size=100, hidden_size=8)
        self.block_manager = SimpleNamespace(block_size=16)
        self.live: dict[str, int] = {}

    def add_request(self, request_id, prompt, params, multimodal=None):
        self.live[request_id] = params.max_tokens

    def abort(self, request_id):
        self.live.pop(request_id, None)

    def has_unfinished(self):
        return bool(self.live)

    def check_ranks(self):  # one process: no rank to lose
        pass

    def shutdown(self):
        pass

    def stats(self):
        return EngineStats(len(self.live), 0, 0.0, 0, 0, 0)

    def step(self):
        self.step_hook()
        outputs = []
        for request_id in list(self.live):
            self.live[request_id] -= 1
            done = self.live[request_id] == 0
            if done:
                del self.live[request_id]
            outputs.append(StepOutput(request_id, [7], finish_reason="length" if done else None))
        time.sleep(0.01)
        return outputs


async def with_app(factory, body, stall_timeout: float = 300.0):
    engine = AsyncEngine(factory, stall_timeout=stall_timeout)
    metrics = Metrics(engine)
    engine.on_request_done = metrics.request_done
    app = build_app(Serving(engine, "m", None, SamplingDefaults(), metrics))
    engine.start()
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
            return await body(http, engine)
    finally:
        engine.stop(timeout=5)


def completion(max_tokens: int = 3) -> dict:
    return {"prompt": [1, 2, 3], "max_tokens": max_tokens}


def test_health_is_503_while_loading_then_200():
    loaded = threading.Event()

    def factory():
        loaded.wait(10)
        return ScriptedEngine()

    async def body(http, engine):
        loading = await http.get("/health")
        probed_loading = await http.head("/health")
        busy = await http.post("/v1/completions", json=completion())
        loaded.set()
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        ready = await http.get("/health")
        probed_ready = await http.head("/health")
        answer = await http.post("/v1/completions", json=completion())
        return loading, busy, ready, answer, (probed_loading.status_code, probed_ready.status_code)

    loading, busy, ready, answer, probed = asyncio.run(with_app(factory, body))
    assert probed == (503, 200)  # a HEAD probe gets the same status
    assert (loading.status_code, loading.json()["status"]) == (503, "loading")
    assert busy.status_code == 503 and busy.headers["Retry-After"]
    assert ready.status_code == 200
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "aaa"


def test_prompts_are_tokenized_off_the_event_loop():
    """A prompt of megabytes takes seconds to tokenize: on the event loop, /health, /metrics and every stream
    stalled that long (a load balancer's probe would call the server dead)."""
    threads: list[threading.Thread] = []

    def factory():
        engine = ScriptedEngine()
        encode = engine.tokenizer.encode
        engine.tokenizer.encode = lambda text, **options: threads.append(threading.current_thread()) or encode(text)
        return engine

    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        answers = [await http.post("/v1/completions", json={"prompt": "a long text", "max_tokens": 2}),
                   await http.post("/tokenize", json={"prompt": "a long text"})]  # fmt: skip
        return [answer.status_code for answer in answers], threading.current_thread()

    statuses, event_loop = asyncio.run(with_app(factory, body))
    assert statuses == [200, 200] and len(threads) == 2 and event_loop not in threads


def test_a_dead_engine_loop_fails_requests_and_health():
    def explode():
        raise RuntimeError("device lost")

    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        in_flight = await http.post("/v1/completions", json=completion())
        health = await http.get("/health")
        later = await http.post("/v1/completions", json=completion())
        return in_flight, health, later

    in_flight, health, later = asyncio.run(with_app(lambda: ScriptedEngine(explode), body))
    assert in_flight.status_code == 503 and "device lost" in in_flight.json()["error"]["message"]
    assert in_flight.json()["error"]["type"] == "service_unavailable_error"  # OpenAI's type of a 503
    assert health.status_code == 503
    assert health.json()["status"] == "dead" and "device lost" in health.json()["error"]
    assert later.status_code == 503


def test_a_stuck_step_makes_health_503():
    release = threading.Event()

    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        request = asyncio.ensure_future(http.post("/v1/completions", json=completion(1)))
        await asyncio.sleep(0.6)
        for _ in range(100):  # on a loaded machine the step may start late: until the stall shows, or 10 s more
            stuck = await http.get("/health")
            if stuck.status_code == 503:
                break
            await asyncio.sleep(0.1)
        release.set()
        await request
        return stuck, await http.get("/health")

    stuck, recovered = asyncio.run(with_app(lambda: ScriptedEngine(lambda: release.wait(10)), body, stall_timeout=0.3))
    assert (stuck.status_code, stuck.json()["status"]) == (503, "stalled")
    assert recovered.status_code == 200


def test_failed_loading_is_reported():
    def factory():
        raise FileNotFoundError("no weights here")

    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        return await http.get("/health")

    health = asyncio.run(with_app(factory, body))
    assert health.status_code == 503 and "no weights here" in health.json()["error"]


def test_a_loading_error_without_a_message_is_named_by_its_type():
    def factory():
        raise MemoryError

    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        return engine.error

    assert asyncio.run(with_app(factory, body)) == "loading failed: MemoryError"


def test_abort_all_ends_streams_while_a_step_runs():
    steps = 0
    release = threading.Event()

    def second_step_blocks():
        nonlocal steps
        steps += 1
        if steps > 1:
            release.wait(30)

    async def body():
        engine = AsyncEngine(lambda: ScriptedEngine(second_step_blocks))
        engine.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
            handle = await engine.submit([([1, 2, 3], SamplingParams(max_tokens=100))])
            stream = engine.stream(handle)
            first = await anext(stream)
            engine.abort_all()  # the engine thread is inside its second step now
            with pytest.raises(EngineUnavailable, match="shutting down"):
                await asyncio.wait_for(anext(stream), 5)
            return first, engine.num_in_flight
        finally:
            release.set()
            engine.stop(timeout=5)

    (_, first), in_flight = asyncio.run(body())
    assert not first.finished()
    assert in_flight == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_answer_cut_off_at_shutdown_is_an_error_the_official_client_reads(stream):
    """What ``abort_all`` (a shutdown past its timeout) cut off: a whole answer is a 503, a stream ends with OpenAI's
    error event after its chunks. Their finish reason was ``abort``, which no OpenAI SDK type allows (vLLM sends it
    too, an open bug there; SGLang answers an error)."""
    engines: list[AsyncEngine] = []
    steps = 0

    def shutdown_at_the_second_step():
        nonlocal steps
        steps += 1
        if steps == 2:  # after a first token: what a stream has sent stays valid
            aborted = threading.Event()
            engines[0].loop.call_soon_threadsafe(lambda: (engines[0].abort_all(), aborted.set()))
            aborted.wait(5)

    async def body(http, engine):
        engines.append(engine)
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
        chunks = []
        with pytest.raises(openai.APIError) as raised:
            answer = await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=50, stream=stream)
            if stream:
                async for chunk in answer:
                    chunks.append(chunk)
        return chunks, raised.value

    chunks, error = asyncio.run(with_app(lambda: ScriptedEngine(shutdown_at_the_second_step), body))
    assert all(choice.finish_reason is None for chunk in chunks for choice in chunk.choices)
    assert len(chunks) == stream  # the first token's
    assert error.body["type"] == "service_unavailable_error" and "shutting down" in error.message
    assert isinstance(error, openai.APIStatusError) != stream and getattr(error, "status_code", 503) == 503


def test_submit_refuses_more_sequences_than_the_queue_holds_whoever_calls_it():
    """``AsyncEngine.submit`` bounds a request's sequences (its prompts times ``n``) by ``max_waiting`` itself, not
    only the server's routes: a ValueError (400 through the server) before anything reaches the engine."""

    async def body():
        engine = AsyncEngine(ScriptedEngine, max_waiting=4)
        engine.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
            with pytest.raises(TooManySequences, match="asks for 6 sequences; one request may ask for at most 4"):
                await engine.submit([([1, 2, 3], SamplingParams(max_tokens=2, n=3))] * 2)
            refused = engine.num_in_flight, engine.engine.live
            accepted = await engine.submit([([1, 2, 3], SamplingParams(max_tokens=2, n=2))] * 2)
            return refused, await engine.collect(accepted)
        finally:
            engine.stop(timeout=5)

    refused, accepted = asyncio.run(body())
    assert refused == (0, {})
    assert [choice.text for choice in accepted] == ["aa"] * 4


def test_a_request_the_engine_took_is_counted_once_against_max_waiting():
    """The engine thread had set ``stats`` (the request among its waiting sequences) before the event loop heard
    that it took the request (still counted as being added): a request checked in between counted it twice ("8
    sequences are waiting (limit 4)" under a burst, and a 429 too early). A request checked there now sees it
    once: the thread's stats reach the loop after its answers."""

    class Waiting(ScriptedEngine):  # the requests it takes wait: none is stepped
        def has_unfinished(self):
            return False

        def stats(self):
            return EngineStats(0, len(self.live), 0.0, 0, 0, 0)

    async def body():
        engine = AsyncEngine(Waiting, max_waiting=2)
        engine.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
            first = asyncio.ensure_future(engine.submit([([1, 2, 3], SamplingParams(max_tokens=2))]))
            await asyncio.sleep(0)  # sent to the engine thread
            while not engine.engine.live:  # taken by it; the loop held, so it has not heard yet
                time.sleep(0.001)
            second = engine.submit([([1, 2, 3], SamplingParams(max_tokens=2))])
            second.send(None)  # the queue check, at this very point (then it awaits the engine's answer)
            second.close()
            await first
        finally:
            engine.stop(timeout=5)

    asyncio.run(body())  # (QueueFull: "2 sequences are waiting (limit 2)")


def test_a_burst_the_running_batch_has_room_for_is_not_refused():
    """--max-waiting counts sequences waiting to start: 32 requests at once to an idle engine with room for 64
    got 16 429s at a limit of 16 (those about to start counted as waiting). Beyond the batch's room they still
    are: a burst of 64 + 16 takes 64 + 16 sequences and refuses the rest."""
    from xinfer.engine.async_engine import QueueFull

    class Roomy(ScriptedEngine):  # room for 64 sequences; the requests it takes wait (none is stepped)
        def has_unfinished(self):
            return False

        def stats(self):
            return EngineStats(0, len(self.live), 0.0, 0, 0, 0, num_free_seqs=64)

    async def body():
        engine = AsyncEngine(Roomy, max_waiting=16)
        engine.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
            outcomes = await asyncio.gather(
                *(engine.submit([([1, 2, 3], SamplingParams(max_tokens=2))]) for _ in range(96)),
                return_exceptions=True,
            )
            return sum(isinstance(outcome, QueueFull) for outcome in outcomes)
        finally:
            engine.stop(timeout=5)

    assert asyncio.run(body()) == 96 - 64 - 16


def stream_through_openai(factory, **fields):
    """The text chunks of a streamed completion read by the official client, and the error it raised."""

    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
        texts = []
        with pytest.raises(openai.APIError) as raised:
            stream = await client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=5, stream=True, **fields)
            async for chunk in stream:
                texts += [choice.text for choice in chunk.choices]
        return texts, raised.value

    return asyncio.run(with_app(factory, body))


def test_an_engine_that_dies_mid_stream_ends_it_with_an_error_event():
    steps = 0

    def second_step_fails():
        nonlocal steps
        steps += 1
        if steps == 2:
            raise RuntimeError("device lost")

    texts, error = stream_through_openai(lambda: ScriptedEngine(second_step_fails))
    assert texts == ["a"] and "device lost" in error.message
    assert error.body["type"] == "service_unavailable_error"


def failing_on_the_event_loop() -> ScriptedEngine:
    """An engine whose tokenizer fails where the server decodes on the event loop's thread (an echoed prompt):
    a bug on the server's side of a request."""
    engine = ScriptedEngine()
    decode = engine.tokenizer.decode

    def decode_off_the_event_loop(ids, skip_special_tokens=True):
        if threading.current_thread() is threading.main_thread():
            raise KeyError("a token without text")
        return decode(ids, skip_special_tokens)

    engine.tokenizer.decode = decode_off_the_event_loop
    return engine


def test_a_server_failure_mid_stream_is_an_error_event_not_a_cut_stream():
    """A bug on the server's side of a stream that already answered 200 reaches the client as OpenAI's error event,
    not a dropped connection."""
    engine = failing_on_the_event_loop()
    _, error = stream_through_openai(lambda: engine, echo=True)
    assert "KeyError: 'a token without text'" in error.message and error.body["type"] == "server_error"


def test_an_unexpected_server_error_is_a_500_that_says_what_failed_and_is_logged_once(caplog):
    """OpenAI's error body, type server_error, with the exception in one line (not only its class name, not the
    traceback); the traceback is logged once: the app answers the request and does not raise the exception on to
    the server (uvicorn logged its traceback a second time; here ASGITransport would raise it into the test)."""
    engine = failing_on_the_event_loop()

    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        return await http.post("/v1/completions", json={**completion(), "echo": True})

    with caplog.at_level(logging.ERROR):
        answer = asyncio.run(with_app(lambda: engine, body))
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    assert "KeyError: 'a token without text'" in error["message"] and "POST /v1/completions" in error["message"]
    assert "Traceback" not in answer.text and "line " not in error["message"]
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [KeyError]


class OneFailingEngine(ScriptedEngine):
    """Fails each request that asks for 5 tokens once it has one, as the engine ends a request whose own work
    (its grammar, its detokenizing, ...) raised; the others go on."""

    def add_request(self, request_id, prompt, params, multimodal=None):
        super().add_request(request_id, prompt, params, multimodal)
        self.failing = getattr(self, "failing", set()) | ({request_id} if params.max_tokens == 5 else set())

    def step(self):
        outputs = super().step()
        for index, output in enumerate(outputs):
            if output.request_id in self.failing and self.live.get(output.request_id) == 3:
                del self.live[output.request_id]
                outputs[index] = StepOutput(output.request_id, [], finish_reason="error", error="ValueError: bad")
        return outputs


def test_a_request_the_engine_fails_is_a_500_and_the_others_go_on():
    async def body(http, engine):
        await asyncio.get_running_loop().run_in_executor(None, engine.wait_loaded)
        failed, answered = await asyncio.gather(
            http.post("/v1/completions", json=completion(max_tokens=5)),
            http.post("/v1/completions", json=completion(max_tokens=3)),
        )
        return failed, answered, await http.get("/health")

    failed, answered, health = asyncio.run(with_app(OneFailingEngine, body))
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert failed.json()["error"]["message"] == "the request failed: ValueError: bad"  # its reason, not its type
    assert answered.status_code == 200 and answered.json()["choices"][0]["text"] == "aaa"
    assert health.status_code == 200


def test_a_request_the_engine_fails_mid_stream_ends_with_an_error_event():
    texts, error = stream_through_openai(OneFailingEngine)
    assert texts == ["a"] and error.body["type"] == "server_error"
