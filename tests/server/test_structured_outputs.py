"""Structured outputs and reasoning through the official ``openai`` client against live
servers: the embedded SmolLM2 (the shared fixture) and a tiny random model whose chat
template reasons (a DeepSeek-R1-like ``<think>`` block the template opens, closed when
``enable_thinking`` is false). Outputs are checked by ``jsonschema`` and ``re``."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.grammar.schemas import SCHEMAS

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def ask_all(client, model: str, extra: dict) -> list:
    client = client.with_options(timeout=600)  # twenty at once on a 2-core machine

    def ask(item):
        topic, schema = item
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Reply with {topic} as JSON."}],
            response_format=json_format(schema),
            temperature=0,
            max_tokens=80,
            extra_body=extra,
        )

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch in the engine
        return list(pool.map(ask, SCHEMAS))


def test_twenty_json_schemas_on_smollm2(client, model):
    for (topic, schema), answer in zip(SCHEMAS, ask_all(client, model, {})):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (topic, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_twenty_json_schemas_on_a_random_model(tiny_client):
    model = tiny_client.models.list().data[0].id
    for (topic, schema), answer in zip(SCHEMAS, ask_all(tiny_client, model, NO_THINKING)):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (topic, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.message.model_extra.get("reasoning_content") is None


def test_choice_regex_grammar_and_json_object(client, model):
    def chat(extra: dict, **kwargs):
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        return client.chat.completions.create(
            model=model, messages=messages, temperature=0, max_tokens=40, extra_body=extra, **kwargs
        ).choices[0]

    assert chat({"structured_outputs": {"choice": ["Paris", "London", "Rome"]}}).message.content in (
        "Paris", "London", "Rome",
    )  # fmt: skip
    assert re.fullmatch(
        r"[A-Z][a-z]+, [A-Z][a-z]+",
        chat({"structured_outputs": {"regex": r"[A-Z][a-z]+, [A-Z][a-z]+"}}).message.content,
    )
    lark = 'start: "The capital is " CITY "."\nCITY: /[A-Z][a-z]{1,10}/'
    assert re.fullmatch(
        r"The capital is [A-Z][a-z]{1,10}\.", chat({"structured_outputs": {"grammar": lark}}).message.content
    )
    # vLLM's former names (guided_choice, guided_regex, guided_json, guided_grammar), which clients still send
    assert chat({"guided_choice": ["Oslo", "Bern"]}).message.content in ("Oslo", "Bern")
    assert re.fullmatch(r"[0-9]{3}", chat({"guided_regex": "[0-9]{3}"}).message.content)
    gbnf = 'root ::= "yes" | "no"'
    assert chat({"structured_outputs": {"grammar": gbnf}}).message.content in ("yes", "no")
    obj = chat({}, response_format={"type": "json_object"})
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.message.content), dict)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
    completion = client.completions.create(
        model=model, prompt="The capital of France as JSON:", max_tokens=30, temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    ).choices[0]  # fmt: skip
    jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize(
    ("extra", "param", "named"),
    [
        ({"response_format": json_format({"type": "objectx"})}, "response_format", "objectx"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "unclosed character class"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "nothing_here"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b!", "schema": {}}}},
            "response_format",
            "name",
        ),
        ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "matches no text"),
        ({"guided_json": {"type": "objectx"}}, "structured_outputs", "objectx"),
    ],
)
def test_invalid_constraints_are_400_naming_the_problem(server, client, model, extra, param, named):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] is None or error["param"].startswith(param)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body=extra)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_reasoning_is_split_and_counted(tiny_client):
    model = tiny_client.models.list().data[0].id
    messages = [{"role": "user", "content": "Think about the sea."}]
    whole = tiny_client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)
    message = whole.choices[0].message
    # the template opened the block and the random model never closes it: everything is reasoning
    assert message.model_extra["reasoning_content"] and message.content == ""
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]  # vLLM's name too
    assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens == 12
    stream = tiny_client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    reasoning, content, usage = "", "", None
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
        usage = chunk.usage or usage
    assert (reasoning, content) == (message.model_extra["reasoning_content"], "")
    assert usage.completion_tokens_details.reasoning_tokens == 12
    off = tiny_client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=12, reasoning_effort="none"
    ).choices[0].message  # fmt: skip
    assert off.model_extra.get("reasoning_content") is None and off.content


def test_an_assistant_turns_reasoning_is_read_under_vllms_name_too():
    from xinfer.server.prompts import message_dicts
    from xinfer.server.protocol import ChatMessage

    turn = {"role": "assistant", "content": "Paris."}
    ours, vllms = ChatMessage(**turn, reasoning_content="r"), ChatMessage(**turn, reasoning="r")
    assert vllms.reasoning_content == "r" and message_dicts([vllms]) == message_dicts([ours])


def test_a_grammar_waits_for_the_end_of_reasoning(tiny_client):
    """While the block is open the output is free (the random model never closes it), so a
    regex that forbids every letter does not hold inside the reasoning."""
    model = tiny_client.models.list().data[0].id
    answer = tiny_client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Think."}], temperature=0, max_tokens=12,
        extra_body={"structured_outputs": {"regex": "[0-9]+"}},
    ).choices[0]  # fmt: skip
    reasoning = answer.message.model_extra["reasoning_content"]
    assert not re.fullmatch("[0-9]*", reasoning)
