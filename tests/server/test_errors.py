"""Bad requests get OpenAI-shaped errors with the right status, and the server keeps serving."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.server.conftest import MAX_BODY_BYTES, MAX_MODEL_LEN

HI = [{"role": "user", "content": "Hi"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
LONG_TEXT = "hello " * (MAX_MODEL_LEN + 200)


def chat(**fields):
    return {"messages": HI, "max_tokens": 2, **fields}


def called(call: dict | None = None, function: dict | None = None, drop: str | None = None) -> dict:
    """A chat body whose history has OpenAI's function call (``call`` and ``function`` changing its fields, a None
    in ``function`` leaving that one out, ``drop`` one of the call's) and the tool's result."""
    whole = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'} | (function or {})} | (call or {})  # fmt: skip
    whole["function"] = {key: value for key, value in whole["function"].items() if value is not None}
    whole = {key: value for key, value in whole.items() if key != drop}
    turn = {"role": "assistant", "content": None, "tool_calls": [whole]}
    return chat(messages=[*HI, turn, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])


# (name, path, body or raw bytes, headers, status, param expected in the error (None: don't check), words in message)
ROWS = [
    ("missing messages", CHAT, {"max_tokens": 2}, {}, 400, "messages", "required"),
    ("empty messages", CHAT, {"messages": []}, {}, 400, "messages", "at least 1"),
    (
        "unknown role",
        CHAT,
        {"messages": [{"role": "wizard", "content": "x"}]},
        {},
        400,
        "messages.0.role",
        'got "wizard"',
    ),
    (
        "text part of wrong type",  # the parts' problem, not the string alternative's
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
        {},
        400,
        "messages.0.content.0.text",
        "got 5",
    ),
    ("content of wrong type", CHAT, {"messages": [{"role": "user", "content": 42}]}, {}, 400, None, "content"),
    ("user message without content", CHAT, {"messages": [{"role": "user"}]}, {}, 400, "messages.0.content", "content"),
    (
        "tool message without tool_call_id",
        CHAT,
        {"messages": [*HI, {"role": "tool", "content": "42"}]},
        {},
        400,
        "messages.1.tool_call_id",
        "tool_call_id",
    ),
    # OpenAI's ChatCompletionMessageFunctionToolCallParam: id, type "function", function.name, function.arguments
    (
        "tool call without function",
        CHAT,
        called(drop="function"),
        {},
        400,
        "messages.1.tool_calls.0.function",
        "required",
    ),
    (
        "tool call without a name",
        CHAT,
        called(function={"name": None}),
        {},
        400,
        "messages.1.tool_calls.0.function.name",
        "required",
    ),
    (
        "tool call arguments as an object",
        CHAT,
        called(function={"arguments": {"city": "Paris"}}),
        {},
        400,
        "messages.1.tool_calls.0.function.arguments",
        "string",
    ),
    (
        "tool call without arguments",
        CHAT,
        called(function={"arguments": None}),
        {},
        400,
        "messages.1.tool_calls.0.function.arguments",
        "required",
    ),
    (
        "tool call of an unknown type",
        CHAT,
        called({"type": "retrieval"}),
        {},
        400,
        "messages.1.tool_calls.0.type",
        "retrieval",
    ),
    ("tool call without an id", CHAT, called(drop="id"), {}, 400, "messages.1.tool_calls.0.id", "required"),
    ("tool call without a type", CHAT, called(drop="type"), {}, 400, "messages.1.tool_calls.0.type", "required"),
    (
        "tool call not an object",
        CHAT,
        chat(messages=[*HI, {"role": "assistant", "tool_calls": ["f()"]}]),
        {},
        400,
        "messages.1.tool_calls.0",
        "object",
    ),
    (
        "image content part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        {},
        400,
        "messages.0.content.0.image_url",
        "text only",
    ),
    (
        "text part without text",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {},
        400,
        "messages.0.content.0",
        "needs its text",
    ),
    ("temperature as a string", CHAT, chat(temperature="hot"), {}, 400, "temperature", 'got "hot"'),
    ("temperature a number in a string", CHAT, chat(temperature="0.5"), {}, 400, "temperature", ""),
    ("negative temperature", CHAT, chat(temperature=-1), {}, 400, "temperature", "0"),
    ("temperature too high", CHAT, chat(temperature=5), {}, 400, "temperature", "equal to 2, got 5"),
    ("top_p zero", CHAT, chat(top_p=0), {}, 400, "top_p", ""),
    ("presence_penalty out of range", CHAT, chat(presence_penalty=3), {}, 400, "presence_penalty", ""),
    ("max_tokens zero", CHAT, chat(max_tokens=0), {}, 400, "max_tokens", "1"),
    ("max_tokens negative", CHAT, chat(max_tokens=-5), {}, 400, "max_tokens", ""),
    ("max_tokens beyond the context", CHAT, chat(max_tokens=10**9), {}, 400, "max_tokens", str(MAX_MODEL_LEN)),
    (
        "max_completion_tokens beyond the context",
        CHAT,
        {"messages": HI, "max_completion_tokens": 10**9},
        {},
        400,
        "max_completion_tokens",
        "lower max_completion_tokens",
    ),
    ("n zero", CHAT, chat(n=0), {}, 400, "n", "got 0"),
    ("n huge", CHAT, chat(n=10_000), {}, 400, "n", "128"),
    ("seed beyond int64", CHAT, chat(seed=2**70), {}, 400, "seed", ""),
    ("top_k beyond int64", CHAT, chat(top_k=2**63), {}, 400, "top_k", ""),  # the engine died on it
    ("top_logprobs 21", CHAT, chat(logprobs=True, top_logprobs=21), {}, 400, "top_logprobs", "20"),
    ("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), {}, 400, "top_logprobs", "logprobs"),
    ("too many stop strings", CHAT, chat(stop=[f"s{i}" for i in range(17)]), {}, 400, "stop", "16"),
    ("empty stop string", CHAT, chat(stop=[""]), {}, 400, "stop", "stop"),
    ("min_tokens above max_tokens", CHAT, chat(min_tokens=5, max_tokens=2), {}, 400, "min_tokens", "min_tokens"),
    (
        "stream_options without stream",
        CHAT,
        chat(stream_options={"include_usage": True}),
        {},
        400,
        "stream_options",
        "stream",
    ),
    (
        "stream_options asking for nothing more without stream",  # vLLM's: only {} is taken without stream
        CHAT,
        chat(stream_options={"include_usage": False}),
        {},
        400,
        "stream_options",
        "stream",
    ),
    ("logit_bias key not a token id", CHAT, chat(logit_bias={"a": 5}), {}, 400, "logit_bias", "logit_bias"),
    # "²" is a digit to str.isdigit, not to int()
    ("logit_bias key a superscript digit", CHAT, chat(logit_bias={"²": 5}), {}, 400, "logit_bias", "²"),
    (
        "streamed completion logit_bias key a superscript digit",
        COMPLETIONS,
        {"prompt": "a", "max_tokens": 1, "stream": True, "logit_bias": {"¹": 5}},
        {},
        400,
        "logit_bias",
        "¹",
    ),
    ("logit_bias above 100", CHAT, chat(logit_bias={"1": 101}), {}, 400, "logit_bias", "101"),
    (
        "logit_bias token outside the vocabulary",
        CHAT,
        chat(logit_bias={str(10**7): 1}),
        {},
        400,
        "logit_bias",
        str(10**7),
    ),
    (
        "stop_token_ids outside the vocabulary",
        CHAT,
        chat(stop_token_ids=[2, 10**7]),
        {},
        400,
        "stop_token_ids",
        str(10**7),
    ),
    ("negative stop_token_ids", CHAT, chat(stop_token_ids=[-1]), {}, 400, "stop_token_ids", "-1"),
    ("logit_bias negative token id", CHAT, chat(logit_bias={"-1": 1}), {}, 400, "logit_bias", "-1"),
    (
        "json_schema response format",
        CHAT,
        chat(response_format={"type": "json_schema"}),
        {},
        400,
        "response_format.json_schema",
        "json_schema",
    ),
    (
        "prompt longer than the context",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_TEXT}]},
        {},
        400,
        "messages",
        str(MAX_MODEL_LEN),
    ),
    ("completion prompt too long", COMPLETIONS, {"prompt": LONG_TEXT}, {}, 400, "prompt", str(MAX_MODEL_LEN)),
    (
        "completion prompt too long, echoed with logprobs",  # checked before the prompt is scored
        COMPLETIONS,
        {"prompt": LONG_TEXT, "echo": True, "logprobs": 1},
        {},
        400,
        "prompt",
        str(MAX_MODEL_LEN),
    ),
    (
        "completion prompt too long, echoed alone with logprobs",
        COMPLETIONS,
        {"prompt": LONG_TEXT, "echo": True, "logprobs": 1, "max_tokens": 0},
        {},
        400,
        "prompt",
        str(MAX_MODEL_LEN),
    ),
    (
        "logit_bias outside the vocabulary, checked before an echoed prompt is scored",
        COMPLETIONS,
        {"prompt": LONG_TEXT, "echo": True, "logprobs": 1, "logit_bias": {str(10**7): 1}},
        {},
        400,
        "logit_bias",
        str(10**7),
    ),
    ("completion without prompt", COMPLETIONS, {"max_tokens": 2}, {}, 400, "prompt", "required"),
    ("truncate_prompt_tokens 0", CHAT, chat(truncate_prompt_tokens=0), {}, 400, "truncate_prompt_tokens", "-1"),
    (
        "truncate_prompt_tokens above the context",  # vLLM's message
        CHAT,
        chat(truncate_prompt_tokens=MAX_MODEL_LEN + 1),
        {},
        400,
        "truncate_prompt_tokens",
        f"truncate_prompt_tokens value ({MAX_MODEL_LEN + 1}) is greater than max_model_len ({MAX_MODEL_LEN})",
    ),
    (
        "completion truncate_prompt_tokens above the context",
        COMPLETIONS,
        {"prompt": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1},
        {},
        400,
        "truncate_prompt_tokens",
        "greater than max_model_len",
    ),
    (
        "completion max_tokens 0 without echo",
        COMPLETIONS,
        {"prompt": "a", "max_tokens": 0},
        {},
        400,
        "max_tokens",
        "echo",
    ),
    ("completion prompt of no accepted type", COMPLETIONS, {"prompt": [[1], "a"]}, {}, 400, "prompt", "prompt"),
    ("completion with empty prompt list", COMPLETIONS, {"prompt": []}, {}, 400, "prompt", "empty"),
    ("token id outside the vocabulary", COMPLETIONS, {"prompt": [1, 2, 10**7]}, {}, 400, "prompt", "token ids"),
    ("negative token id", COMPLETIONS, {"prompt": [-1]}, {}, 400, "prompt", "token ids"),
    ("completion logprobs 21", COMPLETIONS, {"prompt": "a", "logprobs": 21}, {}, 400, "logprobs", "20"),
    ("prompt_logprobs 21", CHAT, chat(prompt_logprobs=21), {}, 400, "prompt_logprobs", "20"),
    (
        "prompt_logprobs with stream",
        COMPLETIONS,
        {"prompt": "a", "max_tokens": 1, "stream": True, "prompt_logprobs": 1},
        {},
        400,
        "prompt_logprobs",
        "stream",
    ),
    ("invalid JSON", CHAT, b'{"messages": [', {}, 400, None, "JSON"),
    ("JSON that is not an object", CHAT, b"[1, 2]", {}, 400, None, "object"),
    ("empty body", CHAT, b"", {}, 400, None, "empty"),
    (
        "wrong content type",
        CHAT,
        json.dumps(chat()).encode(),
        {"Content-Type": "text/plain"},
        400,
        None,
        "application/json",
    ),
    ("unknown model", CHAT, chat(model="no-such-model"), {}, 404, "model", "no-such-model"),
    ("missing API key", CHAT, chat(), {"Authorization": ""}, 401, None, "API key"),
    ("wrong API key", CHAT, chat(), {"Authorization": "Bearer sk-wrong-key"}, 401, None, "API key"),
    ("body over the limit", CHAT, b'{"messages": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}', {}, 413, None, "limit"),
    (
        "embedding encoding unknown",
        "/v1/embeddings",
        {"input": "a", "encoding_format": "hex"},
        {},
        400,
        "encoding_format",
        "",
    ),
    ("embedding of nothing", "/v1/embeddings", {"input": []}, {}, 400, "input", "empty"),
    (
        "allowed token ids past the vocabulary",
        CHAT,
        chat(allowed_token_ids=[10**9]),
        {},
        400,
        "allowed_token_ids",
        "token ids",
    ),
    ("allowed token ids empty", CHAT, chat(allowed_token_ids=[]), {}, 400, "allowed_token_ids", "at least 1"),
    ("a blank bad word", CHAT, chat(bad_words=["ok", " "]), {}, 400, "bad_words", "blank"),
    ("embedding input too long", "/v1/embeddings", {"input": LONG_TEXT}, {}, 400, "input", str(MAX_MODEL_LEN)),
    ("responses input too long", "/v1/responses", {"input": LONG_TEXT}, {}, 400, "input", str(MAX_MODEL_LEN)),
    (
        "tokenize with prompt and messages",
        "/tokenize",
        {"prompt": "a", "messages": HI},
        {},
        400,
        "messages",
        "exactly one",
    ),
    ("tool_choice required without tools", CHAT, chat(tool_choice="required"), {}, 400, "tool_choice", "needs tools"),
    ("best_of other than n", COMPLETIONS, {"prompt": "a", "best_of": 3}, {}, 400, "best_of", "3"),
    (
        "tokenize an image on a text-only model",  # as a chat completion refuses it
        "/tokenize",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]},
        {},
        400,
        "messages.0.content.0.image_url",
        "text only",
    ),
    # each prompt times n is a sequence; more than the queue takes (--max-waiting, 256 here) are refused at once
    (
        "completion of more sequences than the queue",
        COMPLETIONS,
        {"prompt": ["a"] * 200, "n": 2, "max_tokens": 1},
        {},
        400,
        "prompt",
        "400 sequences",
    ),
    (
        "completion of a million sequences",
        COMPLETIONS,
        {"prompt": [[1]] * 10**5, "n": 10, "max_tokens": 1},
        {},
        400,
        "prompt",
        "at most 256",
    ),
    ("detokenize a negative id", "/detokenize", {"tokens": [-3]}, {}, 400, "tokens", "token ids"),
    ("unknown route", "/v1/nothing-here", {}, {}, 404, None, "/v1/nothing-here"),
    # OpenAI requires a tool's type and an object tool_choice's (ChatCompletionFunctionToolParam,
    # ChatCompletionNamedToolChoiceParam); custom tools and allowed_tools are types this server does not run
    ("tool without a type", CHAT, chat(tools=[{"function": {"name": "f"}}]), {}, 400, "tools.0.type", "function"),
    (
        "custom tool",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}, {"type": "custom", "custom": {"name": "c"}}]),
        {},
        400,
        "tools.1.type",
        "custom",
    ),
    (
        "tool_choice without a type",
        CHAT,
        chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice={"function": {"name": "f"}}),
        {},
        400,
        "tool_choice.type",
        "function",
    ),
    (
        "tool_choice of allowed tools",
        CHAT,
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
        ),
        {},
        400,
        "tool_choice.type",
        "allowed_tools",
    ),
    # OpenAI's chat fields asking for what this server does not do: refused, not ignored (the answer would be
    # other than the one asked for)
    ("audio output", CHAT, chat(audio={"voice": "alloy", "format": "wav"}), {}, 400, "audio", "audio"),
    ("audio modality", CHAT, chat(modalities=["text", "audio"]), {}, 400, "modalities", "text"),
    ("deprecated functions", CHAT, chat(functions=[{"name": "f"}]), {}, 400, "functions", "tools"),
    ("deprecated function_call", CHAT, chat(function_call="auto"), {}, 400, "function_call", "tool_choice"),
    ("moderation", CHAT, chat(moderation={"model": "omni-moderation-latest"}), {}, 400, "moderation", "moderation"),
    ("web search", CHAT, chat(web_search_options={}), {}, 400, "web_search_options", "web search"),
    ("verbosity", CHAT, chat(verbosity="low"), {}, 400, "verbosity", "medium"),
    (  # vLLM takes them per request; here the image processor is the server's
        "image processor settings",
        CHAT,
        chat(mm_processor_kwargs={"max_pixels": 1024}),
        {},
        400,
        "mm_processor_kwargs",
        "--mm-processor-kwargs",
    ),
    (
        "deprecated function_call in history",
        CHAT,
        chat(messages=[*HI, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}]),
        {},
        400,
        "messages.1.function_call",
        "tool_calls",
    ),
    ("reasoning_effort unknown", CHAT, chat(reasoning_effort="extreme"), {}, 400, "reasoning_effort", "xhigh"),
]

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
}


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_bad_request(server, row):
    _, path, body, headers, status, param, words = row
    request_headers = {**server.headers, "Content-Type": "application/json", **headers}
    if request_headers.get("Authorization") == "":
        del request_headers["Authorization"]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers=request_headers, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ERROR_TYPES[status]
    assert error["message"] and words.lower() in error["message"].lower(), error["message"]
    if param is not None:
        assert error["param"] == param, error
    if status == 401:
        assert response.headers["WWW-Authenticate"] == "Bearer"
    if "too long" in row[0]:
        assert error["code"] == "context_length_exceeded", error


@pytest.mark.parametrize("path, body", [(CHAT, chat()), (COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})])
def test_empty_stream_options_need_no_stream(server, path, body):
    """As vLLM's: stream_options that ask for nothing ({}) are taken without stream."""
    response = server.post(path, body | {"stream_options": {}})
    assert response.status_code == 200, response.text


def test_an_empty_model_name_is_the_served_model(server, model):
    """As vLLM takes it (an absent field is too)."""
    response = server.post(CHAT, chat(model=""))
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model


def test_a_body_nested_past_the_json_parsers_depth_is_parsed_and_its_deep_schema_named(server):
    """pydantic's JSON parser stops at about 200 levels, Python's (FastAPI's, so vLLM's) does not: such a body is
    valid JSON, and the error names what is too deep for the grammar engine (a tool's parameters nested 150
    objects deep), not the body as invalid JSON."""
    schema: dict = {"type": "string"}
    for _ in range(150):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "deep", "parameters": schema}}
    response = server.post(CHAT, chat(tools=[tool]))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "tools[0].function.parameters" in error["message"], error
    assert "not valid JSON" not in error["message"]


def test_wrong_method(server):
    response = httpx.get(server.url + CHAT, headers=server.headers)
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_client_gone_mid_body_leaves_no_traceback(server):
    """A client that closes its connection before its body is all sent: nobody reads an answer, so nothing is an
    error (it was an unexpected ClientDisconnect: a 500 and two tracebacks in the log)."""
    before = server.log_path.read_text().count("Traceback")
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as connection:
        connection.sendall(head.encode() + b'{"messages": [')
        connection.shutdown(socket.SHUT_WR)
        assert connection.recv(1024) == b""  # closed, no answer
    assert httpx.get(server.url + "/health").status_code == 200
    time.sleep(0.5)  # the handler's log lines, had there been any
    assert server.log_path.read_text().count("Traceback") == before


def test_unknown_model_through_the_client(client):
    import openai

    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-17", messages=HI, max_tokens=1)
    assert raised.value.body["code"] == "model_not_found"


def test_good_request_after_the_bad_ones(server, client, model):
    for row in ROWS[:5]:
        test_bad_request(server, row)
    reply = client.chat.completions.create(model=model, messages=HI, max_tokens=4)
    assert reply.choices[0].message.content
    assert httpx.get(server.url + "/health").status_code == 200
