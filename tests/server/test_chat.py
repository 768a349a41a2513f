"""/v1/chat/completions through the official openai client."""

from __future__ import annotations

import pytest

from tests.server.conftest import assert_usage_so_far

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def test_non_streaming_answer_has_openai_shape(client, model):
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert reply.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 40
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_stream_equals_non_stream_at_temperature_0(client, model):
    whole = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32)
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    # OpenAI's chunk object: "Each chunk has the same ID" and "the same timestamp"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_no_usage_chunk_unless_asked(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_finish_reason_stop_length_and_stop_string(client, model):
    natural = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=200)
    assert natural.choices[0].finish_reason == "stop"  # the model ends its one sentence
    assert natural.usage.completion_tokens < 200

    short = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=3)
    assert short.choices[0].finish_reason == "length"
    assert short.usage.completion_tokens == 3

    text = natural.choices[0].message.content
    words = text.split()
    stop = " " + words[len(words) // 2]  # a stop string the greedy answer is known to contain
    cut = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=200, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop  # vLLM's
    assert cut.choices[0].message.content == text[: text.index(stop)]
    streamed = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=200, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # vLLM's stop_reason, on the finishing chunk
    assert [getattr(c.choices[0], "stop_reason", None) for c in chunks] == [None] * (len(chunks) - 1) + [stop]
    kept = client.chat.completions.create(  # vLLM's extra field
        model=model, messages=QUESTION, temperature=0, max_tokens=200, stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].message.content == text[: text.index(stop) + len(stop)]


def test_n_with_seed_is_reproducible(client, model):
    ask = dict(model=model, messages=QUESTION, n=2, seed=1234, temperature=1.0, max_tokens=16)
    first, second = client.chat.completions.create(**ask), client.chat.completions.create(**ask)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert all(c.message.content for c in first.choices)


def test_repeated_system_prompt_reports_cached_tokens(client, model):
    system = "You are a meticulous assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    second = client.chat.completions.create(
        model=model, messages=messages[:1] + [{"role": "user", "content": "Say goodbye."}], max_tokens=4
    )
    assert first.usage.prompt_tokens > 300
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 256, cached  # the shared system prompt, in whole blocks
    assert cached < second.usage.prompt_tokens


def test_logprobs(client, model):
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == values[0]  # greedy takes the most likely token
        assert bytes(entry.bytes).decode() == entry.token


def test_logprob_bytes_join_to_the_answer(client, model):
    """A token holding part of a character has the text U+FFFD but its own bytes, as OpenAI gives them."""
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, logprobs=True, top_logprobs=2,
        extra_body={"structured_outputs": {"choice": ["🍴 ok", "🍎 fine"]}},
    )  # fmt: skip
    answer, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
    assert answer in ("🍴 ok", "🍎 fine")
    assert any(entry.token == "\ufffd" for entry in content)
    assert b"".join(bytes(entry.bytes) for entry in content) == answer.encode()


def test_null_fields_mean_their_defaults(server, client, model):
    """OpenAI's schema lets these fields be null (the client sends an explicit None as null)."""
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=2, n=None, logprobs=None, stream=None, temperature=None,
        top_p=None, stop=None, seed=None, presence_penalty=None, user=None, tool_choice=None, response_format=None,
    )  # fmt: skip
    assert len(reply.choices) == 1 and reply.choices[0].logprobs is None
    body = {"prompt": "Hi", "max_tokens": 2, "echo": None, "logprobs": None, "best_of": None, "n": None}
    completion = server.post("/v1/completions", body)
    assert completion.status_code == 200 and len(completion.json()["choices"]) == 1
    missing = server.post("/v1/completions", {"prompt": None, "max_tokens": 2})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"


def test_sampling_parameters_are_accepted(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_completion_tokens=5,
        temperature=0.7,
        top_p=0.9,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert reply.usage.completion_tokens <= 5


# OpenAI's chat fields that ask for nothing this server does not do anyway: accepted and ignored
NEUTRAL_FIELDS = {
    "store": True, "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "service_tier": "flex",
    "prompt_cache_key": "k", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
    "prediction": {"type": "content", "content": "Paris"},  # an OpenAI speed-up: the answer is the same without
    "modalities": ["text"], "verbosity": "medium", "web_search_options": None, "audio": None, "functions": [],
    "mm_processor_kwargs": {},  # vLLM's: nothing to change
}  # fmt: skip


@pytest.mark.parametrize("effort", [None, "xhigh", "max"])  # OpenAI's ReasoningEffort, a template's to read
def test_fields_that_ask_for_nothing_more_leave_the_answer_as_it_is(client, model, effort):
    plain = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=8)
    stream_options = {"include_usage": True, "include_obfuscation": False}
    with_fields = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=8, reasoning_effort=effort, stream=True,
        stream_options=stream_options, extra_body=NEUTRAL_FIELDS,
    )  # fmt: skip
    chunks = list(with_fields)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_reasoning_tokens_are_counted_as_none_for_a_model_that_does_not_reason(client, model):
    """OpenAI's usage has completion_tokens_details on every chat completion: 0 reasoning tokens here."""
    whole = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=4)
    streamed = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=4, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    assert list(streamed)[-1].usage.completion_tokens_details.reasoning_tokens == 0


REFUSAL = "I can't help with that."


@pytest.mark.parametrize(
    "refused",
    [
        {"role": "assistant", "content": None, "refusal": REFUSAL},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": REFUSAL}]},
    ],
    ids=["refusal field", "refusal part"],
)
def test_an_assistant_refusal_given_back_is_what_it_said(server, client, model, refused):
    """A refusal in history (OpenAI's assistant message with ``refusal`` and null content, or a refusal part) is
    the assistant's turn with that text, as a client sending a previous answer back has it."""
    turns = [*QUESTION, refused, {"role": "user", "content": "Why not?"}]
    as_text = [*QUESTION, {"role": "assistant", "content": REFUSAL}, {"role": "user", "content": "Why not?"}]
    prompt = server.post("/tokenize", {"messages": turns}).json()["tokens"]
    assert prompt == server.post("/tokenize", {"messages": as_text}).json()["tokens"]
    reply = client.chat.completions.create(model=model, messages=turns, temperature=0, max_tokens=4)
    assert reply.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_text", "text": "Hi"},
        {"type": "output_text", "text": "Hi"},
        {"type": "thinking", "thinking": "Hi"},
    ],
    ids=lambda part: part["type"],
)
def test_parts_vllm_reads_as_text_are_text(server, part):
    """vLLM's chat parser reads Responses-style ``input_text`` / ``output_text`` parts and ``thinking`` parts as
    text parts (its MM_PARSER_MAP), as the offline ``LLM.chat`` does here: they were a 400."""
    as_text = server.post("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]})
    given = server.post("/tokenize", {"messages": [{"role": "user", "content": [part]}]})
    assert given.status_code == 200, given.text
    assert given.json()["tokens"] == as_text.json()["tokens"]
    empty = server.post("/tokenize", {"messages": [{"role": "user", "content": [{"type": part["type"]}]}]})
    assert empty.status_code == 400 and "needs its" in empty.json()["error"]["message"]


def test_a_developer_message_is_a_system_message_where_the_template_knows_no_developer(server, client, model):
    """OpenAI's developer role replaced system; SmolLM2's template knows only system (and writes a default system
    prompt before a conversation that does not start with one)."""
    rule = "Answer in French."
    as_developer = [{"role": "developer", "content": rule}, *QUESTION]
    prompt = server.post("/tokenize", {"messages": as_developer}).json()["tokens"]
    assert (
        prompt
        == server.post("/tokenize", {"messages": [{"role": "system", "content": rule}, *QUESTION]}).json()["tokens"]
    )
    reply = client.chat.completions.create(model=model, messages=as_developer, temperature=0, max_tokens=2)
    assert reply.usage.prompt_tokens == len(prompt)


def test_logit_bias_forces_and_bans_tokens(server, client, model):
    """OpenAI's logit_bias: +100 makes a token certain even when sampling, -100 rules it out."""
    forced = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=1.0, max_tokens=3, logprobs=True, logit_bias={"42": 100}
    )
    assert len({entry.token for entry in forced.choices[0].logprobs.content}) == 1
    greedy = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=1)
    first = greedy.choices[0].message.content
    ids = server.post("/tokenize", json={"model": model, "prompt": first, "add_special_tokens": False}).json()["tokens"]
    banned = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=1, logit_bias={str(ids[0]): -100}
    )
    assert banned.choices[0].message.content != first


def test_streaming_n_2_interleaves_choices(client, model):
    ask = dict(model=model, messages=QUESTION, n=2, seed=99, max_tokens=12)
    whole = client.chat.completions.create(**ask)
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize("n", [1, 2])
def test_continuous_usage_stats_on_every_chunk(server, client, model, n):
    """vLLM's stream_options.continuous_usage_stats: each chunk (the role's too) carries its choice's usage so far,
    never ahead of the tokens streamed, never summed over the choices."""
    chunks = list(
        client.chat.completions.create(
            model=model, messages=QUESTION, n=n, max_tokens=12, seed=1, stream=True, logprobs=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    prompt_tokens = len(server.post("/tokenize", json={"model": model, "messages": QUESTION}).json()["tokens"])
    assert_usage_so_far(
        chunks, [prompt_tokens], n, lambda choice: len(choice.logprobs.content or []) if choice.logprobs else 0
    )
    assert chunks[-1].usage.completion_tokens == n * 12


def test_token_ids_returned_as_vllm_returns_them(server, model):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:<id>" (the byte pieces of "你好" are all
    U+FFFD by their text), the chosen token's bytes its own, an alternative's its name's, as vLLM gives them;
    return_token_ids: the response's prompt_token_ids (streamed: on each choice's first chunk) and each choice's."""
    body = {"messages": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "allowed_token_ids": [18645, 250, 48392, 138], "return_token_ids": True}  # fmt: skip
    by_text = server.post("/v1/chat/completions", body).json()
    by_ids = server.post("/v1/chat/completions", body | {"return_tokens_as_token_ids": True}).json()
    assert by_ids["prompt_token_ids"] == server.post("/tokenize", {"messages": QUESTION}).json()["tokens"]
    [choice] = by_ids["choices"]
    content, text_content = choice["logprobs"]["content"], by_text["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert [entry["bytes"] for entry in content] == [entry["bytes"] for entry in text_content]
    assert {entry["token"] for entry in text_content} == {"\ufffd"}
    alternatives = [top for entry in content for top in entry["top_logprobs"]]
    assert len(alternatives) == 2 * len(content)
    assert all(top["token"].startswith("token_id:") and bytes(top["bytes"]) == top["token"].encode()
               for top in alternatives)  # fmt: skip
    streamed = body | {"stream": True, "return_tokens_as_token_ids": True}
    chunks = [data["choices"][0] | {"prompt_token_ids": data.get("prompt_token_ids")}
              for _, data in server.events("/v1/chat/completions", streamed)]  # fmt: skip
    assert [c["prompt_token_ids"] for c in chunks] == [by_ids["prompt_token_ids"]] + [None] * (len(chunks) - 1)
    assert [t for c in chunks for t in c.get("token_ids", [])] == choice["token_ids"]
    assert [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]] == content
    plain = server.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


def test_prompt_logprobs_on_the_response(server, client, model):
    """vLLM's prompt_logprobs on a chat response: the rendered prompt's tokens scored as /v1/completions scores
    them (the first null)."""
    token_ids = server.post("/tokenize", json={"model": model, "messages": QUESTION}).json()["tokens"]
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    scores = reply.prompt_logprobs
    assert len(scores) == len(token_ids) == reply.usage.prompt_tokens and scores[0] is None
    echoed = client.completions.create(model=model, prompt=token_ids, max_tokens=0, echo=True, logprobs=1)
    for token, entry, logprob in zip(token_ids[1:], scores[1:], echoed.choices[0].logprobs.token_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
        ranks = sorted(e["rank"] for e in entry.values())  # the likeliest, and the prompt's token where it is not
        assert ranks[0] == 1 and len(entry) == len(ranks) <= 2 and (entry[str(token)]["rank"] == 1) == (len(entry) == 1)
    assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=1).prompt_logprobs is None


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"n": 2, "logprobs": True, "top_logprobs": 2, "seed": 1, "user": "u", "metadata": {"k": "v"}},
        {"stop": [" the", "."], "max_tokens": 3},
        {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 80},
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "n": 2,
            "max_tokens": 80,
        },
        {"response_format": {"type": "json_object"}},
    ],
    ids=["n logprobs", "stop and length", "required tool", "named tool", "json"],
)
def test_bodies_and_chunks_are_the_clients_types(server, model, options):
    """Validated by the client's own pydantic types (its parser constructs them unchecked); one finish per choice,
    usage that adds up."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    body = {"model": model, "messages": QUESTION, "max_tokens": 30, "temperature": 0} | options
    n = body.get("n", 1)
    whole = ChatCompletion.model_validate(server.post("/v1/chat/completions", json=body).json())
    assert [choice.index for choice in whole.choices] == list(range(n)) and whole.id.startswith("chatcmpl-")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    named = isinstance(body.get("tool_choice"), dict)  # a named function's call finishes with stop, as OpenAI's
    for choice in whole.choices:
        assert (choice.finish_reason == "tool_calls") == (bool(choice.message.tool_calls) and not named)
    streamed = body | {"stream": True, "stream_options": {"include_usage": True}}
    chunks = [ChatCompletionChunk.model_validate(data) for _, data in server.events("/v1/chat/completions", streamed)]
    finishes = [(c.index, c.finish_reason) for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finishes) == sorted((c.index, c.finish_reason) for c in whole.choices)
    *_, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert {chunk.id for chunk in chunks} == {chunks[0].id}
