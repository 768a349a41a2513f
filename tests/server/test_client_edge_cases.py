"""Edge cases through the official clients. Histories that the official APIs refuse: tool results that answer no
call and calls left unanswered (OpenAI's and Anthropic's pairing rules), and Anthropic's rules on turns without
content and on a prefill that ends in whitespace; each is a 400 in the API's own error shape, and the server serves
the next request. JSON schemas that list their properties without ``additionalProperties``: the answer holds those
keys only."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from tests.server.conftest import API_KEY

HI = {"role": "user", "content": "Hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                              "input": {"city": "Paris"}}]}  # fmt: skip
TOOL_RESULT = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}


def result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def test_content_parts_are_at_least_one(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": []}], max_tokens=2)
    assert caught.value.param == "messages.0.content" and "at least one part" in caught.value.body["message"]


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        ([HI, result("call_1")], "messages.1", "'call_1'"),  # no call before it
        ([HI, CALLED, result("call_2")], "messages.2", "'call_2'"),  # a call of another id
        ([HI, CALLED, result("call_1"), HI, result("call_1")], "messages.4", "'call_1'"),  # not right after the call
        ([HI, CALLED, HI], "messages.1", "call_1"),  # the call unanswered
        ([HI, CALLED], "messages.1", "call_1"),
        ([HI, CALLED | {"tool_calls": [CALL, CALL | {"id": "call_2"}]}, result("call_2")], "messages.1", "call_1"),
    ],
    ids=[
        "result without call",
        "result of another id",
        "result after a user turn",
        "call unanswered",
        "call last",
        "one of two calls unanswered",
    ],
)
def test_tool_messages_must_answer_the_calls_before_them(client, model, messages, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert caught.value.param == param and caught.value.type == "invalid_request_error"
    assert words in caught.value.body["message"]
    answered = client.chat.completions.create(model=model, messages=[HI, CALLED, result("call_1")], max_tokens=2)
    assert answered.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("messages", "named"),
    [
        ([TOOL_RESULT], "messages.0.content.0: unexpected tool_use_id"),
        (
            [HI, TOOL_USE, TOOL_RESULT | {"content": [{"type": "tool_result", "tool_use_id": "toolu_2"}]}],
            "messages.2.content.0: unexpected tool_use_id found in tool_result blocks: toolu_2",
        ),
        ([HI, TOOL_USE, HI], "messages.1: tool_use ids were found without tool_result blocks"),
        ([HI, TOOL_USE], "messages.1: tool_use ids were found without tool_result blocks"),
        ([{"role": "user", "content": ""}], "messages.0: all messages must have non-empty content"),
        ([{"role": "user", "content": " \n"}], "messages.0: all messages must have non-empty content"),
        ([{"role": "user", "content": []}], "messages.0: all messages must have non-empty content"),
        ([HI, {"role": "assistant", "content": ""}, HI], "messages.1: all messages must have non-empty content"),
        ([{"role": "user", "content": [{"type": "text", "text": ""}]}], "messages.0.content.0: text content blocks"),
        ([HI, {"role": "assistant", "content": "Hello "}], "messages.1: final assistant content cannot end with"),
    ],
    ids=[
        "result without tool_use",
        "result of another id",
        "tool_use unanswered",
        "tool_use last",
        "empty text",
        "blank text",
        "no blocks",
        "empty assistant turn",
        "empty text block",
        "prefill ending in whitespace",
    ],
)
def test_anthropic_refuses_what_its_api_refuses(claude, model, messages, named):
    for call in (claude.messages.create, claude.messages.count_tokens):
        with pytest.raises(anthropic.BadRequestError) as caught:
            call(model=model, messages=messages, **({"max_tokens": 2} if call == claude.messages.create else {}))
        error = caught.value.body["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith(named), error
    answered = claude.messages.create(model=model, max_tokens=2, messages=[HI, TOOL_USE, TOOL_RESULT])
    assert answered.stop_reason in ("end_turn", "max_tokens")
    assert claude.messages.create(model=model, max_tokens=2, messages=[HI, {"role": "assistant", "content": ""}])


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip


@pytest.mark.parametrize("strict", [True, None])
def test_a_schema_that_lists_its_properties_gets_only_those(client, model, strict):
    """A schema without ``additionalProperties`` (OpenAI's strict schemas must say false; vLLM's grammars read it
    so): the answer holds the listed keys and ends, not extra keys until max_tokens cuts the JSON."""
    schema = {"name": "person", "schema": PERSON} | ({"strict": strict} if strict else {})
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me a person as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": schema},
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and set(json.loads(choice.message.content)) == {"name", "age"}


def test_a_forced_call_has_only_the_listed_arguments(client, model):
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=60, temperature=0,
    )  # fmt: skip
    [call] = answer.choices[0].message.tool_calls
    assert set(json.loads(call.function.arguments)) == {"city"}
