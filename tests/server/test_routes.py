"""/v1/completions, /v1/models, /v1/embeddings, /tokenize, /detokenize, /health, /metrics."""

from __future__ import annotations

import base64
import math
import struct
import time

import httpx
import pytest

from tests.llama_cpp_oracle import llama_cpp_llama
from tests.server.conftest import MAX_MODEL_LEN, assert_usage_so_far
from xinfer.loading.resolve import default_model_path


def test_completion_with_a_list_of_prompts(client, model):
    prompts = ["The capital of France is", "One, two, three,"]
    reply = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0)
    assert reply.object == "text_completion"
    assert [c.index for c in reply.choices] == [0, 1]
    for prompt, choice in zip(prompts, reply.choices):
        alone = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert choice.text == alone.choices[0].text
        assert choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 16


def test_completion_with_token_ids_matches_text_prompt(client, model, server):
    prompt = "The capital of France is"
    token_ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=token_ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(token_ids)
    two = client.completions.create(model=model, prompt=[token_ids, token_ids[:3]], max_tokens=2, temperature=0)
    assert len(two.choices) == 2


def test_completion_n_with_prompt_list_orders_choices(client, model):
    reply = client.completions.create(model=model, prompt=["Hello", "Goodbye"], n=2, max_tokens=3, seed=5)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]


def test_completion_echo_and_logprobs(client, model, server):
    """The echoed prompt's tokens carry their log-probabilities (the first none), as OpenAI's legacy API and vLLM
    give them."""
    prompt = "The capital of France is"
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    logprobs = choice.logprobs
    num_prompt, generated = reply.usage.prompt_tokens, reply.usage.completion_tokens
    assert len(logprobs.tokens) == num_prompt + generated
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    # OpenAI's "up to logprobs + 1": the 2 most likely and the token itself
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert 2 <= len(top) <= 3 and top[token] == logprob
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    # a token's score depends on the tokens before it only (tests/engine/test_prompt_logprobs.py checks the
    # values against transformers)
    prompt_ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    longer = client.completions.create(
        model=model, prompt=prompt_ids + prompt_ids, max_tokens=1, temperature=0, echo=True, logprobs=0
    )
    shorter = client.completions.create(model=model, prompt=prompt_ids, max_tokens=1, echo=True, logprobs=0)
    head = longer.choices[0].logprobs.token_logprobs[1 : len(prompt_ids)]
    scored = shorter.choices[0].logprobs
    assert scored.top_logprobs[1:] == [{t: lp} for t, lp in zip(scored.tokens[1:], scored.token_logprobs[1:])]
    assert head == pytest.approx(shorter.choices[0].logprobs.token_logprobs[1 : len(prompt_ids)], abs=1e-4)


def test_completion_echo_with_max_tokens_0_scores_the_prompt_alone(client, model):
    """max_tokens 0 with echo (vLLM's, and OpenAI's legacy way to score a text): the prompt and its logprobs."""
    prompt = "The capital of France is"
    scored = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice, num_prompt = scored.choices[0], scored.usage.prompt_tokens
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens_details.cached_tokens == 0  # as every answer's usage has it
    longer = client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True, logprobs=1)
    expected = longer.choices[0].logprobs
    assert choice.logprobs.tokens == expected.tokens[:num_prompt]
    assert choice.logprobs.token_logprobs == pytest.approx(expected.token_logprobs[:num_prompt], abs=1e-4)
    stream = client.completions.create(
        model=model, prompt=[prompt, "Hi"], max_tokens=0, echo=True, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert [(c.index, c.text) for chunk in chunks for c in chunk.choices] == [(0, prompt), (1, "Hi")]
    assert chunks[-1].usage.completion_tokens == 0 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_completion_echo_gives_the_prompt_as_sent_where_the_tokenizer_adds_a_bos(tmp_path):
    """vLLM echoes a text prompt as the client sent it (prompt_text + output.text) and token ids decoded; the BOS
    its tokenizer adds is the first of the logprobs' tokens. xinfer echoed '<|im_start|>Hello world'."""
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig

    from tests.server.live import LiveServer
    from tests.tiny_models import save_tiny_model
    from xinfer.text.tokenizer import Tokenizer

    backend = Tokenizer.from_gguf(default_model_path()).backend
    bos = backend.token_to_id("<|im_start|>")
    backend.post_processor = TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    (tmp_path / "tokenizer.json").write_text(backend.to_str())
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}')
    save_tiny_model(LlamaConfig(vocab_size=backend.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                architectures=["LlamaForCausalLM"]), tmp_path)  # fmt: skip
    live = LiveServer("--m", str(tmp_path), "--max-model-len", "128", "--cpu", name="bos").start()
    try:
        answer = live.post("/v1/completions", {"prompt": "Hello world", "echo": True, "max_tokens": 2, "logprobs": 0})
        choice = answer.json()["choices"][0]
        assert choice["text"].startswith("Hello world") and choice["logprobs"]["tokens"][0] == "<|im_start|>"
        scored = live.post("/v1/completions", {"prompt": "Hello world", "echo": True, "max_tokens": 0}).json()
        assert scored["choices"][0]["text"] == "Hello world"
        ids = live.post("/v1/completions", {"prompt": [bos, 19556], "echo": True, "max_tokens": 0}).json()
        assert ids["choices"][0]["text"] == backend.decode([bos, 19556], skip_special_tokens=False)
    finally:
        live.stop()


def test_completion_stop_reason_is_on_the_finishing_chunk(client, model):
    """vLLM's stop_reason (the stop string that ended a choice): on the whole choice, and streamed on the chunk that
    finishes it."""
    prompt = "The capital of France is"
    words = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0).choices[0].text.split()
    stop = words[len(words) // 2]
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert whole.choices[0].finish_reason == "stop" and whole.choices[0].stop_reason == stop
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0, stop=[stop],
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    reasons = [(c.choices[0].finish_reason, c.choices[0].stop_reason) for c in chunks]
    assert reasons[-1] == ("stop", stop) and set(reasons[:-1]) == {(None, None)}


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, model, server):
    """vLLM's truncate_prompt_tokens: a prompt longer than the context runs on its last tokens."""
    prompt = "one two three " * (MAX_MODEL_LEN // 2)
    ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    cut = client.completions.create(
        model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": 8}
    )
    expected = client.completions.create(model=model, prompt=ids[-8:], max_tokens=2, temperature=0)
    assert cut.usage.prompt_tokens == 8 and cut.choices[0].text == expected.choices[0].text
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=1,
        extra_body={"truncate_prompt_tokens": 8},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == 8
    whole = {"truncate_prompt_tokens": -1}  # as many as the context holds: here, the whole short prompt
    assert (
        client.completions.create(model=model, prompt=ids[:8], max_tokens=1, extra_body=whole).usage.prompt_tokens == 8
    )


@pytest.mark.parametrize("max_tokens", [0, 2])
def test_echo_with_logprobs_gives_the_prompt_logprobs(server, client, model, max_tokens):
    """vLLM's: echo with logprobs N and no prompt_logprobs scores each choice's prompt as prompt_logprobs N does."""
    prompts = ["The capital of France is", "Hi there"]
    lengths = [len(server.post("/tokenize", {"prompt": p}).json()["tokens"]) for p in prompts]
    ask = dict(model=model, prompt=prompts, n=2, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0)
    echoed = client.completions.create(**ask).choices
    asked = client.completions.create(**ask, extra_body={"prompt_logprobs": 2}).choices
    assert [len(c.prompt_logprobs) for c in echoed] == [len(c.prompt_logprobs) for c in asked]
    assert [len(c.prompt_logprobs) for c in echoed] == [lengths[0]] * 2 + [lengths[1]] * 2
    for by_echo, by_field in zip(echoed, asked):
        assert by_echo.prompt_logprobs[0] is None
        for entry, expected in zip(by_echo.prompt_logprobs[1:], by_field.prompt_logprobs[1:]):
            assert entry.keys() == expected.keys()
            for token, scores in entry.items():
                assert scores["logprob"] == pytest.approx(expected[token]["logprob"], abs=1e-4)
                assert scores["decoded_token"] == expected[token]["decoded_token"]


def test_completion_max_tokens_defaults_to_16(client, model):
    """OpenAI's legacy completions (and vLLM's) generate 16 tokens where max_tokens is not given."""
    reply = client.completions.create(model=model, prompt="Once upon a time", extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"


def test_streamed_completion_equals_whole(client, model):
    whole = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0)
    chunks = list(
        client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize(("prompts", "n"), [(["Once upon a time"], 1), (["Hello", "The sky is"], 2)])
def test_continuous_usage_stats_on_every_completion_chunk(server, client, model, prompts, n):
    """vLLM's stream_options.continuous_usage_stats: each chunk carries its choice's usage so far (completions too),
    never ahead of the tokens streamed, never summed over the choices or prompts."""
    chunks = list(
        client.completions.create(
            model=model, prompt=prompts, n=n, max_tokens=8, stream=True, logprobs=0, seed=1,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    prompt_tokens = [len(server.post("/tokenize", {"prompt": p}).json()["tokens"]) for p in prompts]
    assert_usage_so_far(chunks, prompt_tokens, n, lambda choice: len(choice.logprobs.tokens))
    assert chunks[-1].usage.completion_tokens == len(prompts) * n * 8


# the byte pieces of "你好": four token ids whose text is U+FFFD alike, told apart by their ids alone
PIECES = [18645, 250, 48392, 138]


def test_token_ids_returned_as_vllm_returns_them(server):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>" (the echoed prompt's too);
    return_token_ids: each choice's prompt_token_ids and token_ids (streamed: the prompt's on the first chunk)."""
    prompt = "Say hello"
    prompt_ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2, "allowed_token_ids": PIECES,
            "return_tokens_as_token_ids": True, "return_token_ids": True}  # fmt: skip
    [choice] = server.post("/v1/completions", body).json()["choices"]
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 4
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for name, logprob, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert top[name] == logprob and len(top) >= 2 and all(key.startswith("token_id:") for key in top)
    chunks = [data["choices"][0] for _, data in server.events("/v1/completions", body | {"stream": True})]
    assert [c.get("prompt_token_ids") for c in chunks] == [prompt_ids] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert [t for c in chunks for t in c["logprobs"]["tokens"]] == logprobs["tokens"]
    [echoed] = server.post("/v1/completions", body | {"echo": True}).json()["choices"]
    assert echoed["logprobs"]["tokens"] == [f"token_id:{t}" for t in prompt_ids + choice["token_ids"]]
    assert echoed["token_ids"] == choice["token_ids"]
    [plain] = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprobs": 0}).json()["choices"]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    assert not plain["logprobs"]["tokens"][0].startswith("token_id:")


def test_prompt_logprobs_as_vllm_gives_them(server, client, model):
    """vLLM's prompt_logprobs on each choice: per prompt token (the first null) a dict by token id of
    {logprob, rank, decoded_token} holding the token and the likeliest there, ranked; the scores echo gives."""
    prompt = "The capital of France is"
    token_ids = server.post("/tokenize", {"prompt": prompt}).json()["tokens"]
    ask = dict(model=model, prompt=prompt, extra_body={"prompt_logprobs": 2})
    reply = client.completions.create(**ask, max_tokens=1, n=2)
    alone = client.completions.create(**ask, max_tokens=0, echo=True).choices[0]
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2).choices[0]
    assert [len(c.prompt_logprobs) for c in reply.choices] == [len(token_ids)] * 2 == [reply.usage.prompt_tokens] * 2
    for scores in (reply.choices[0].prompt_logprobs, reply.choices[1].prompt_logprobs, alone.prompt_logprobs):
        assert scores[0] is None
        expected = zip(token_ids[1:], echoed.logprobs.tokens[1:], echoed.logprobs.token_logprobs[1:],
                       echoed.logprobs.top_logprobs[1:])  # fmt: skip
        for entry, (token, text, logprob, top) in zip(scores[1:], expected):
            assert entry[str(token)]["decoded_token"] == text
            assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
            ranked = sorted(entry.values(), key=lambda e: e["rank"])
            assert [e["rank"] for e in ranked][:2] == [1, 2]
            likeliest = sorted(top.values(), reverse=True)[:2]
            assert [e["logprob"] for e in ranked[:2]] == pytest.approx(likeliest, abs=1e-4)
            own = entry[str(token)]  # ranked in the whole vocabulary, as vLLM ranks it
            assert (own["rank"] > 2) == (own["logprob"] < likeliest[1] - 1e-6) == (len(entry) == 3)
    unasked = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert unasked.choices[0].prompt_logprobs is None


def test_models_lists_the_served_model(client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert models[0].object == "model" and models[0].owned_by
    time.sleep(1.1)  # a card's `created` is the model's, not the request's time
    retrieved = client.models.retrieve(model)
    assert retrieved.id == model and retrieved.created == models[0].created <= time.time()


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_similarity(client, model):
    text = "The cat sat on the mat."
    reply = client.embeddings.create(model=model, input=[text, text, "Quarterly revenue grew by four percent."])
    first, same, other = (d.embedding for d in reply.data)
    assert [d.index for d in reply.data] == [0, 1, 2]
    assert abs(cosine(first, same) - 1) < 1e-4
    assert cosine(first, other) < 0.999
    assert reply.usage.prompt_tokens > 0
    assert reply.usage.model_dump() == {"prompt_tokens": reply.usage.prompt_tokens,  # OpenAI's fields, no others
                                        "total_tokens": reply.usage.prompt_tokens}  # fmt: skip
    alone = client.embeddings.create(model=model, input=text).data[0].embedding
    assert abs(cosine(first, alone) - 1) < 1e-4


def test_embeddings_are_llama_cpps(server, model):
    """llama.cpp's embedding mode on the served GGUF file pools the same final hidden states (after the output norm).
    It computes them with its own quantized kernels: the same direction to a cosine of 0.995 (two unlike texts are
    at about 0.7 here) and the same length within 2 %."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the GGUF oracle)")
    text = "The cat sat on the mat."
    for pooling, kind in [("mean", llama_cpp.LLAMA_POOLING_TYPE_MEAN), ("last", llama_cpp.LLAMA_POOLING_TYPE_LAST)]:
        reference = llama_cpp_llama(default_model_path(), embedding=True, pooling_type=kind, n_ctx=64, n_threads=1)
        expected = reference.embed(text)
        body = {"model": model, "input": text, "pooling": pooling, "normalize": False}
        got = server.post("/v1/embeddings", body).json()["data"][0]["embedding"]
        assert cosine(got, expected) > 0.995, pooling
        assert math.hypot(*got) == pytest.approx(math.hypot(*expected), rel=0.02), pooling


def test_embeddings_float_and_base64_agree(server, model):
    body = {"model": model, "input": "hello there"}
    floats = server.post("/v1/embeddings", {**body, "encoding_format": "float"}).json()["data"][0]["embedding"]
    raw = server.post("/v1/embeddings", {**body, "encoding_format": "base64"}).json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(floats)}f", base64.b64decode(raw))
    assert max(abs(a - b) for a, b in zip(floats, decoded)) < 1e-6
    last = server.post("/v1/embeddings", {**body, "pooling": "last"}).json()["data"][0]["embedding"]
    assert len(last) == len(floats) and last != floats


def test_tokenize_detokenize_round_trip(server, client, model):
    text = "Hello, world! Ünïcödé and emoji 🙂 survive."
    tokens = server.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    back = server.post("/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back["prompt"] == text
    messages = [{"role": "user", "content": "Hi there"}]
    chat_tokens = server.post("/tokenize", {"messages": messages}).json()
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert chat_tokens["count"] == reply.usage.prompt_tokens


def test_health_is_open_and_metrics_are_exported(server, client, model):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = server.metrics()
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    after = server.metrics()
    for name in (
        "xinfer_num_requests_running",
        "xinfer_num_requests_waiting",
        "xinfer_kv_cache_usage",
        "xinfer_prefix_cache_queries_total",
        "xinfer_prefix_cache_hits_total",
        "xinfer_num_preemptions_total",
        "xinfer_steps_total",
        "xinfer_step_sequences_total",
        "xinfer_step_tokens_total",
    ):
        assert name in after, name
    assert after["xinfer_prompt_tokens_total"] > before.get("xinfer_prompt_tokens_total", 0)
    assert after["xinfer_step_tokens_total"] > before.get("xinfer_step_tokens_total", 0)
    assert after["xinfer_generation_tokens_total"] >= before.get("xinfer_generation_tokens_total", 0) + 1
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        key = f"xinfer_{histogram}_seconds_count"
        assert after[key] > before.get(key, 0), key
    assert after['xinfer_requests_finished_total{finish_reason="length"}'] >= 1


def test_completion_bodies_and_chunks_are_the_clients_types(server, model):
    """Validated by the client's own pydantic types (its parser constructs them unchecked). A streamed chunk before a
    choice's last has finish_reason null, as OpenAI's do, which the client's type does not allow: those are checked
    by hand."""
    from openai.types import Completion

    body = {
        "model": model,
        "prompt": ["Once upon", "The sky"],
        "n": 2,
        "max_tokens": 4,
        "logprobs": 2,
        "temperature": 0,
    }
    whole = Completion.model_validate(server.post("/v1/completions", json=body).json())
    assert [choice.index for choice in whole.choices] == [0, 1, 2, 3] and whole.id.startswith("cmpl-")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    events = server.events("/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}})
    finished = []
    for _, chunk in events[:-1]:
        [choice] = chunk["choices"]
        if choice["finish_reason"] is None:
            assert set(choice) >= {"index", "text", "logprobs"} and chunk["object"] == "text_completion"
        else:
            finished += [c.index for c in Completion.model_validate(chunk).choices]
    assert sorted(finished) == [0, 1, 2, 3]
    usage = Completion.model_validate(events[-1][1])
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens


def test_a_browser_on_another_origin_may_call_the_api(server):
    """CORS, every origin by default as vLLM's and llama.cpp's servers: the preflight is answered without the API
    key (browsers send none with it), and the answers carry the origin header."""
    origin = {"Origin": "http://app.example"}
    preflight = httpx.options(
        server.url + "/v1/chat/completions",
        headers={**origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"},
    )  # fmt: skip
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answer = server.get("/v1/models", headers=origin)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
    refused = httpx.get(server.url + "/v1/models", headers=origin)  # without the key: 401, still readable
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_allowed_token_ids_are_the_only_tokens_a_completion_takes(server):
    """vLLM's extra parameter ``allowed_token_ids``."""
    allowed = server.post("/tokenize", {"prompt": " yes no", "add_special_tokens": False}).json()["tokens"]
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 1.0, "seed": 1, "logprobs": 0,
            "ignore_eos": True, "allowed_token_ids": allowed}  # fmt: skip
    reply = server.post("/v1/completions", body)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= {" yes", " no"}, tokens


def test_bad_words_are_not_in_a_completion(server):
    """vLLM's extra parameter ``bad_words``: the greedy answer names Paris; banned, the word is not written."""
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    plain = server.post("/v1/completions", body).json()["choices"][0]["text"]
    banned = server.post("/v1/completions", {**body, "bad_words": ["Paris"]}).json()["choices"][0]["text"]
    assert "Paris" in plain and "Paris" not in banned, (plain, banned)


def test_embedding_inputs_are_counted_as_openai_reads_them():
    """A list of token ids is one input (OpenAI's); 300 of them were refused as 300 inputs."""
    from pydantic import ValidationError

    from xinfer.server.protocol import MAX_EMBEDDING_INPUTS, EmbeddingRequest

    assert EmbeddingRequest.model_validate({"input": list(range(300))}).input == list(range(300))
    with pytest.raises(ValidationError, match=f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got 257"):
        EmbeddingRequest.model_validate({"input": ["a"] * 257})
