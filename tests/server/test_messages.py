"""Anthropic's Messages API through the official ``anthropic`` client against live servers:
the embedded SmolLM2 behind an API key (the shared fixture) and the tiny random model whose
template reasons. Answers are checked against the same conversation sent through
``/v1/chat/completions`` with the official ``openai`` client (greedy, so they must agree),
event streams against Anthropic's documented order."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.server.conftest import API_KEY, MAX_MODEL_LEN

GREEDY = {"temperature": 0}  # anthropic 2.x has no temperature argument: it goes as an extra field
SYSTEM = "You answer in one short sentence."
TURNS = [
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "An apple."},
    {"role": "user", "content": "Name another one."},
]


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


def openai_answer(client, model, messages, max_tokens, **kwargs):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def test_text_with_system_and_turns_is_the_chat_completion(claude, client, model):
    message = claude.messages.create(
        model=model, max_tokens=24, system=SYSTEM, messages=TURNS, extra_body=GREEDY
    )  # fmt: skip
    completion = openai_answer(client, model, [{"role": "system", "content": SYSTEM}, *TURNS], 24)
    expected = completion.choices[0]
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == expected.message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[expected.finish_reason]
    assert message.stop_sequence is None
    assert message.usage.output_tokens == completion.usage.completion_tokens


def test_system_as_blocks_and_content_as_blocks(claude, model):
    as_text = claude.messages.create(model=model, max_tokens=12, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    blocks = claude.messages.create(
        model=model, max_tokens=12, system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": t["role"], "content": [{"type": "text", "text": t["content"]}]} for t in TURNS],
        extra_body=GREEDY,
    )  # fmt: skip
    assert blocks.content[0].text == as_text.content[0].text


def test_max_tokens_and_usage(claude, client, model):
    message = claude.messages.create(
        model=model, max_tokens=5, messages=[{"role": "user", "content": "Write a long story."}], extra_body=GREEDY
    )
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    counted = claude.messages.count_tokens(model=model, messages=[{"role": "user", "content": "Write a long story."}])
    # prompt tokens found in the prefix cache are counted apart, as Anthropic counts them
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == counted.input_tokens


def test_a_final_assistant_turn_is_continued(claude, client, model):
    """Anthropic's prefill: the answer goes on from the final assistant text (vLLM's continue_final_message)."""
    turns = [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1, 2, 3,"}]
    message = claude.messages.create(model=model, max_tokens=8, messages=turns, extra_body=GREEDY)
    expected = client.chat.completions.create(
        model=model, messages=turns, max_tokens=8, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    assert message.content[0].text == expected.choices[0].message.content
    assert claude.messages.count_tokens(model=model, messages=turns).input_tokens == expected.usage.prompt_tokens
    empty = claude.messages.create(model=model, max_tokens=2, messages=[turns[0], {"role": "assistant", "content": ""}],
                                   extra_body=GREEDY)  # fmt: skip
    assert empty.content[0].text == openai_answer(client, model, turns[:1], 2).choices[0].message.content


def test_consecutive_messages_of_one_role_are_one_turn(claude, model):
    """As Anthropic's API combines them: two user messages are the turn of one message with both texts as its
    blocks, and a prefill split over two assistant messages is continued as one (whole and counted)."""
    file, ask = {"type": "text", "text": "Here is a file."}, {"type": "text", "text": "Summarize it."}
    two_users = [{"role": "user", "content": file["text"]}, {"role": "user", "content": [ask]}]
    one_user = [{"role": "user", "content": [file, ask]}]
    count = claude.messages.count_tokens
    assert count(model=model, messages=two_users).input_tokens == count(model=model, messages=one_user).input_tokens
    count_to_ten = {"role": "user", "content": "Count to ten."}
    split = [count_to_ten, {"role": "assistant", "content": "1, 2,"}, {"role": "assistant", "content": " 3,"}]
    whole = [count_to_ten, {"role": "assistant", "content": "1, 2, 3,"}]
    continued = claude.messages.create(model=model, max_tokens=8, messages=split, extra_body=GREEDY)
    expected = claude.messages.create(model=model, max_tokens=8, messages=whole, extra_body=GREEDY)
    assert continued.content[0].text == expected.content[0].text
    assert count(model=model, messages=split).input_tokens == count(model=model, messages=whole).input_tokens


def test_a_tool_use_is_answered_by_the_next_turn_of_combined_messages(claude, model):
    use = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [use]},
        {"role": "assistant", "content": "Let me check."},
        {"role": "user", "content": [result]},
        {"role": "user", "content": "Be brief."},
    ]
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    message = claude.messages.create(model=model, max_tokens=4, tools=tools, messages=turns, extra_body=GREEDY)
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_count_tokens_is_the_chat_prompt(claude, client, model):
    counted = claude.messages.count_tokens(model=model, system=SYSTEM, messages=TURNS)
    usage = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, *TURNS], max_tokens=1
    ).usage
    assert counted.input_tokens == usage.prompt_tokens
    assert claude.messages.count_tokens(model=model, messages=TURNS).input_tokens != counted.input_tokens


def test_stop_sequences(claude, model):
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    free = claude.messages.create(model=model, max_tokens=30, messages=messages, extra_body=GREEDY).content[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    cut = claude.messages.create(
        model=model, max_tokens=30, messages=messages, stop_sequences=[stop], extra_body=GREEDY
    )  # fmt: skip
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == free[: free.index(stop)]


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


def test_streaming_events_in_order(server, claude, model):
    whole = claude.messages.create(model=model, max_tokens=16, messages=TURNS, extra_body=GREEDY)  # caches the prompt
    body = {"model": model, "max_tokens": 16, "messages": TURNS, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events)  # the event line names the data's type
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    deltas = [data["delta"] for _, data in events[3:-3]]
    assert all(d["type"] == "text_delta" for d in deltas)
    final = events[-2][1]
    assert "".join(d["text"] for d in deltas) == whole.content[0].text
    assert final["delta"]["stop_reason"] == whole.stop_reason
    assert final["usage"]["output_tokens"] == whole.usage.output_tokens
    # message_start's input usage is the final one (the prompt's cached tokens apart), as Anthropic's is
    assert start["usage"]["cache_read_input_tokens"] == final["usage"]["cache_read_input_tokens"] > 0
    assert start["usage"]["input_tokens"] == final["usage"]["input_tokens"]


def test_streaming_through_the_client(claude, model):
    whole = claude.messages.create(model=model, max_tokens=16, system=SYSTEM, messages=TURNS, extra_body=GREEDY)
    with claude.messages.stream(
        model=model, max_tokens=16, system=SYSTEM, messages=TURNS, extra_body=GREEDY
    ) as stream:  # fmt: skip
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_structured_output_format(claude, model):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}  # fmt: skip
    message = claude.messages.create(
        model=model, max_tokens=40, messages=[{"role": "user", "content": "The capital of France, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}}, extra_body=GREEDY,
    )  # fmt: skip
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_x_api_key_and_bearer_are_both_accepted(server, model):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=API_KEY, max_retries=0, timeout=120)
    assert bearer.messages.count_tokens(model=model, messages=TURNS).input_tokens > 0
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0, timeout=120)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=model, max_tokens=2, messages=TURNS)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert "x-api-key" in body["error"]["message"]


def test_a_plain_text_document_is_read_as_text(server, claude, model):
    """A document block's text, title and context reach the prompt, laid out between tags as Anthropic's
    long-context prompting guide lays documents out."""
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Pears are green."},
                "title": "Fruit facts", "context": "From a grocer."}  # fmt: skip
    question = {"type": "text", "text": "What colour are pears?"}
    counted = claude.messages.count_tokens(model=model, messages=[{"role": "user", "content": [document, question]}])
    text = ("<document>\n<title>Fruit facts</title>\n<context>From a grocer.</context>\n<document_content>\n"
            "Pears are green.\n</document_content>\n</document>\nWhat colour are pears?")  # fmt: skip
    tokens = server.post("/tokenize", json={"model": model, "messages": [{"role": "user", "content": text}]})
    assert counted.input_tokens == tokens.json()["count"]


SEARCH_RESULT = {"type": "search_result", "source": "https://x", "title": "t", "content": [{"type": "text", "text": "x"}]}  # fmt: skip


def document_turn(source: dict) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "document", "source": source}]}]}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0: "),  # no text
        (  # the list's problem, not the string alternative's
            {
                "messages": [
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}
                ]
            },
            "messages.0.content.0.input: Input should be an object",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
        (document_turn({"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}), "'base64'"),
        (document_turn({"type": "text", "media_type": "text/html", "data": "<p>Hi</p>"}), "text/plain"),
        (
            {
                "system": "Be brief.",  # the chat request's first message: the error names the block in this body
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is it?"},
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                            },
                        ],
                    }
                ],
            },
            "messages.0.content.1: this model takes text only",
        ),
        (  # an image a tool returned, to a text-only model
            {
                "messages": [
                    {"role": "user", "content": "Look"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "shot", "input": {}}]},
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [
                                    {"type": "text", "text": "here"},
                                    {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
                                ],
                            }
                        ],
                    },
                ]
            },
            "messages.2.content.0.content.1: this model takes text only",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
        ({"stop_sequences": [""]}, "stop_sequences: stop strings"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_k": 2**63}, "top_k"),
        # what this server does not run is refused, not ignored
        ({"container": "container_1"}, "container: "),
        ({"mcp_servers": [{"type": "url", "url": "https://example.com/sse", "name": "x"}]}, "mcp_servers: "),
        ({"thinking": {"type": "sometimes"}}, "thinking.type: "),  # Anthropic's ThinkingConfigParam types
        # Anthropic's bounds of a thinking budget: given where enabled, at least 1024, below max_tokens
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens: Field required"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}, "max_tokens": 2000}, "thinking.budget_tokens: "),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "max_tokens: must be greater than thinking.budget"),
        ({"tools": [{"name": "weather", "description": "no schema"}]}, "tools.0.input_schema: Field required"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort: "),
        (  # a search_result block (its source a string) is a block this server does not read
            {"messages": [{"role": "user", "content": [SEARCH_RESULT]}]},
            "messages.0.content.0: a user turn cannot hold a content block of type 'search_result'",
        ),
    ],
)
def test_bad_requests_are_400_in_anthropic_shape(server, claude, model, change, named):
    body = {"model": model, "max_tokens": 4, "messages": TURNS} | change
    body = {k: v for k, v in body.items() if v is not None}
    response = server.post("/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):  # extra_body's fields replace the client's
        claude.messages.create(model=model, max_tokens=4, messages=TURNS, extra_body=change)


def test_bookkeeping_fields_leave_the_answer_as_it_is(claude, model):
    """Anthropic's fields that change no answer here: caching hints (the prefix cache is automatic), metadata,
    service tier, speed, region, diagnostics, the caller's ids, effort and a thinking budget (a local model thinks
    as its template lets it; the budget is only checked against Anthropic's bounds, so it goes to count_tokens,
    which has no max_tokens to exceed it)."""
    plain = claude.messages.create(model=model, max_tokens=8, messages=TURNS, extra_body=GREEDY)
    fields = {
        "cache_control": {"type": "ephemeral"}, "metadata": {"user_id": "u"}, "service_tier": "auto",
        "speed": "standard", "inference_geo": "us", "diagnostics": {"previous_message_id": "msg_1"},
        "user_profile_id": "u", "workspace_id": "w", "output_config": {"effort": "xhigh"},
        **GREEDY,
    }  # fmt: skip
    message = claude.messages.create(model=model, max_tokens=8, messages=TURNS, extra_body=fields)
    assert message.content[0].text == plain.content[0].text and message.stop_reason == plain.stop_reason
    budget = claude.messages.count_tokens(
        model=model, messages=TURNS, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert budget.input_tokens == claude.messages.count_tokens(model=model, messages=TURNS).input_tokens


def test_unknown_model_and_route_errors(server, claude):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="claude-nonexistent", max_tokens=2, messages=TURNS)
    assert caught.value.body["error"]["type"] == "not_found_error"
    response = server.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    # the OpenAI routes keep OpenAI's shape
    assert "param" in server.post("/v1/chat/completions", json={"messages": []}).json()["error"]


def test_tool_use_and_tool_result_turns_are_accepted(claude, model):
    tools = [{"name": "weather", "description": "The weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]  # fmt: skip
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"}]},
    ]
    message = claude.messages.create(model=model, max_tokens=8, tools=tools, messages=turns, extra_body=GREEDY)
    assert message.content[0].type == "text" and message.usage.output_tokens > 0


def test_thinking_blocks(tiny):
    model = tiny.client().models.list().data[0].id
    claude = anthropic.Anthropic(base_url=tiny.url, api_key="unused", max_retries=0, timeout=300)
    turns = [{"role": "user", "content": "Think about the sea."}]
    whole = claude.messages.create(model=model, max_tokens=10, messages=turns, extra_body=GREEDY)
    # the template opened the block and the random model never closes it: all of it is thinking
    assert [block.type for block in whole.content] == ["thinking"] and whole.content[0].thinking
    with claude.messages.stream(model=model, max_tokens=10, messages=turns, extra_body=GREEDY) as stream:
        kinds = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert set(kinds) == {"thinking_delta"} and final.content[0].thinking == whole.content[0].thinking
    off = claude.messages.create(
        model=model, max_tokens=10, messages=turns, thinking={"type": "disabled"}, extra_body=GREEDY
    )  # fmt: skip
    assert [block.type for block in off.content] == ["text"]


WEATHER = {"name": "weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}  # fmt: skip


def test_a_forced_tool_is_a_tool_use_block(claude, model):
    turns = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "tool", "name": "weather"}
    message = claude.messages.create(
        model=model, max_tokens=40, tools=[WEATHER], tool_choice=choice, messages=turns, extra_body=GREEDY
    )  # fmt: skip
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1, message
    assert uses[0].name == "weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with claude.messages.stream(
        model=model, max_tokens=40, tools=[WEATHER], tool_choice=choice, messages=turns, extra_body=GREEDY
    ) as stream:  # fmt: skip
        final = stream.get_final_message()
    streamed = [block for block in final.content if block.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in streamed] == [("weather", uses[0].input)]
    assert all(b.id.startswith("toolu_") for b in streamed)


def test_models_through_the_anthropic_client(claude, model):
    """/v1/models answers Anthropic's client too: its model fields and a page that ends."""
    listed = list(claude.models.list())
    assert [m.id for m in listed] == [model] and listed[0].type == "model" and listed[0].display_name
    retrieved = claude.models.retrieve(model)
    assert retrieved.created_at == listed[0].created_at and retrieved.created_at.tzinfo is not None
    # the client's parser constructs them unchecked: its type validates every field it requires (lifecycle)
    for card in (*listed, retrieved):
        assert anthropic.types.ModelInfo.model_validate(card.model_dump()).lifecycle == "active"


def test_the_models_limits_are_the_servers(server, claude, model):
    """Anthropic's ModelInfo limits: a prompt of max_input_tokens is served (one token left to generate), a token
    more is refused; max_tokens is the most a one-token prompt leaves."""
    info = claude.models.retrieve(model)
    assert info.max_input_tokens == info.max_tokens == MAX_MODEL_LEN - 1
    for length, status in ((info.max_input_tokens, 200), (info.max_input_tokens + 1, 400)):
        body = {"prompt": [1] * length, "max_tokens": 1, "temperature": 0}
        assert server.post("/v1/completions", json=body).status_code == status
    for max_tokens, status in ((info.max_tokens, 200), (info.max_tokens + 1, 400)):
        body = {"prompt": [1], "max_tokens": max_tokens, "stream": True}  # its status is all that is read
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers) as response:
            assert response.status_code == status


@pytest.mark.parametrize(
    "options",
    [
        {"system": [{"type": "text", "text": SYSTEM}], "metadata": {"user_id": "u"}},
        {"stop_sequences": ["a", "."], "max_tokens": 3},
        {
            "tools": [
                {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
            ],
            "tool_choice": {"type": "any"},
        },
    ],
    ids=["system blocks", "stop sequence", "tool use"],
)
def test_bodies_and_events_are_the_clients_types(server, model, options):
    """Validated by the client's own pydantic types (its parser constructs them unchecked), in Anthropic's order."""
    import typing

    event_types = {typing.get_args(kind.model_fields["type"].annotation)[0]: kind
                   for kind in typing.get_args(typing.get_args(anthropic.types.RawMessageStreamEvent)[0])}  # fmt: skip
    body = {"model": model, "max_tokens": 30, "messages": TURNS, **GREEDY} | options
    whole = anthropic.types.Message.model_validate(server.post("/v1/messages", json=body).json())
    assert whole.id.startswith("msg_") and whole.stop_reason in ("end_turn", "max_tokens", "stop_sequence", "tool_use")
    assert (whole.stop_reason == "stop_sequence") == (whole.stop_sequence is not None)
    events = [(name, data) for name, data in server.events("/v1/messages", body | {"stream": True})
              if data["type"] != "ping"]  # fmt: skip
    for name, data in events:
        assert name == data["type"]
        event_types[data["type"]].model_validate(data)
    kinds = [data["type"] for _, data in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == whole.stop_reason


TWO_CALLS = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
)


def read_with(parallel: bool, text: str):
    from xinfer.server.chat_run import ChatPrompt
    from xinfer.server.messages.calls import read_calls
    from xinfer.server.tools import ToolUse
    from xinfer.toolcalls import parser_for

    prompt = ChatPrompt("", [], [], None, False, ToolUse([], parser_for("hermes")(), parallel))
    text, calls = read_calls(prompt, text)
    return text, [(call.name, call.input) for call in calls]


def test_disable_parallel_tool_use_keeps_the_first_call_of_a_whole_answer():
    """As the streamed answer does (and vLLM's serving_chat where parallel_tool_calls is false): one tool_use."""
    assert read_with(False, TWO_CALLS) == ("Checking.\n", [("get_weather", {"city": "Paris"})])
    assert read_with(True, TWO_CALLS)[1] == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]


def test_a_call_whose_input_is_not_an_object_is_text():
    """A tool_use block's input is an object: what vLLM's hermes parser cannot json.loads is the answer's text."""
    for text in [
        '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
    ]:
        assert read_with(True, text) == (text, [])
