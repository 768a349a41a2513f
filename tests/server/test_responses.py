"""OpenAI's Responses API through the official ``openai`` client against the embedded SmolLM2
(the shared ``server`` fixture) and the tiny random model whose template reasons. Answers are
checked against the same conversation sent through ``/v1/chat/completions`` (greedy, so they
must agree); streams through the client's own stream helper, which checks the events' order
and identities as it accumulates them."""

from __future__ import annotations

import typing

import openai
import pytest
from openai.types.responses import Response, ResponseIncludable, ResponseStreamEvent

# the client's type of each stream event, by its "type"
EVENT_TYPES = {
    typing.get_args(kind.model_fields["type"].annotation)[0]: kind
    for kind in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}

OUTPUT_LOGPROBS = "message.output_text.logprobs"
INSTRUCTIONS = "You answer in one short sentence."
TURNS = [
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "An apple."},
    {"role": "user", "content": "Name another one."},
]


def chat_answer(client, model, messages, max_tokens):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


@pytest.fixture(scope="module")
def whole(client, model):
    return client.responses.create(model=model, input=TURNS, max_output_tokens=16, temperature=0)


def test_a_response_is_the_chat_completion(client, model, whole):
    response = whole
    chat = chat_answer(client, model, TURNS, 16)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == model
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [part.type for part in message.content] == ["output_text"] and message.content[0].annotations == []
    assert response.output_text == chat.choices[0].message.content
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    # SmolLM2 names one fruit in fewer tokens than the limit
    assert chat.choices[0].finish_reason == "stop" and response.status == message.status == "completed"
    assert response.incomplete_details is None and response.completed_at >= response.created_at


def test_instructions_and_content_parts_are_chat_messages(client, model):
    parts = [{"role": t["role"], "content": [{"type": "input_text" if t["role"] == "user" else "output_text",
                                              "text": t["content"]}]} for t in TURNS]  # fmt: skip
    response = client.responses.create(
        model=model, instructions=INSTRUCTIONS, input=parts, max_output_tokens=16, temperature=0
    )
    chat = chat_answer(client, model, [{"role": "system", "content": INSTRUCTIONS}, *TURNS], 16)
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens and response.instructions == INSTRUCTIONS


def test_the_token_limit_makes_an_incomplete_response(client, model):
    response = client.responses.create(model=model, input="Write a long story.", max_output_tokens=16, temperature=0)
    chat = chat_answer(client, model, [{"role": "user", "content": "Write a long story."}], 16)
    assert response.output_text == chat.choices[0].message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 16 and response.output[0].status == "incomplete"
    assert response.max_output_tokens == 16 and response.output_text


def test_a_streamed_response(client, model, whole):
    stream = client.responses.create(model=model, input=TURNS, max_output_tokens=16, temperature=0, stream=True)
    events = list(stream)
    kinds = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]  # fmt: skip
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(deltas) > 1
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text and final.status == "completed"
    assert final.id == events[0].response.id and final.usage.output_tokens == whole.usage.output_tokens


def test_reasoning_is_a_reasoning_item(tiny, tiny_client):
    model = tiny_client.models.list().data[0].id
    turns = [{"role": "user", "content": "Think about the sea."}]
    response = tiny_client.responses.create(model=model, input=turns, max_output_tokens=16, temperature=0)
    chat = chat_answer(tiny_client, model, turns, 16).choices[0].message
    # the template opened the block and the random model never closes it: all of it is reasoning
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.status == "incomplete"
    assert reasoning.content[0].text == chat.reasoning_content and response.output_text == ""
    assert response.usage.output_tokens_details.reasoning_tokens == 16
    # the client's stream helper checks the items' identities as it accumulates the events
    with tiny_client.responses.stream(model=model, input=turns, max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
    deltas = [event.delta for event in events if event.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == chat.reasoning_content and events[-1].type == "response.incomplete"
    assert [item.type for item in events[-1].response.output] == ["reasoning"]
    off = tiny_client.responses.create(model=model, input=turns, max_output_tokens=16, temperature=0,
                                       reasoning={"effort": "none"})  # fmt: skip
    assert [item.type for item in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0


def test_a_named_call_streams_after_the_reasoning(tiny, tiny_client):
    """A named function's call opens with the answer's first text, after the reasoning: streamed, the items are the
    whole response's, in its order, one function_call item (the random model reasons until the token limit, so the
    call is the grammar's empty start); on chat completions the call's first piece comes after the reasoning."""
    model = tiny_client.models.list().data[0].id
    turns = [{"role": "user", "content": "Think about the sea."}]
    named = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = tiny_client.responses.create(model=model, input=turns, max_output_tokens=16, temperature=0, **named)
    with tiny_client.responses.stream(model=model, input=turns, max_output_tokens=16, temperature=0, **named) as stream:
        events = list(stream)
    streamed = events[-1].response

    def items(response: Response) -> list[tuple]:
        return [(i.type, i.status, getattr(i, "name", None), getattr(i, "arguments", None)) for i in response.output]

    assert items(streamed) == items(whole) and [i.type for i in whole.output] == ["reasoning", "function_call"]
    assert [e.item.type for e in events if e.type == "response.output_item.added"] == ["reasoning", "function_call"]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chunks = tiny_client.chat.completions.create(
        model=model, messages=turns, max_tokens=16, temperature=0, stream=True, tools=chat_tools,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    deltas = [chunk.choices[0].delta for chunk in chunks]
    reasoned = [i for i, delta in enumerate(deltas) if getattr(delta, "reasoning_content", None)]
    called = [i for i, delta in enumerate(deltas) if delta.tool_calls]
    assert reasoned and called and max(reasoned) <= min(called)


def test_text_format_is_the_chat_response_format(client, model):
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}
    text = {"format": {"type": "json_schema", "name": "fruit", "schema": schema, "strict": True}}
    response = client.responses.create(model=model, input=TURNS, text=text, max_output_tokens=16, temperature=0)
    chat = client.chat.completions.create(
        model=model, messages=TURNS, max_tokens=16, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "fruit", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert response.output_text == chat.choices[0].message.content and response.output_text.startswith('{"fruit": ')


WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        {"instructions": INSTRUCTIONS, "metadata": {"k": "v"}},
        {"input": "Write a long story.", "max_output_tokens": 16},  # incomplete
        {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}},  # a function_call item
        {"text": {"format": {"type": "json_object"}}},
        {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
    ],
    ids=["completed", "incomplete", "function call", "json", "logprobs"],
)
def test_bodies_and_events_are_the_clients_types(server, model, options):
    """Validated by the client's own pydantic types (its parser constructs them unchecked): every field they
    require is there with its type, such as the usage's ``input_tokens_details.cache_write_tokens``."""
    body = {"model": model, "input": TURNS, "max_output_tokens": 30, "temperature": 0} | options
    whole = Response.model_validate(server.post("/v1/responses", json=body).json())
    events = server.events("/v1/responses", body | {"stream": True})
    for name, event in events:
        assert name == event["type"]
        EVENT_TYPES[event["type"]].model_validate(event)
    streamed = Response.model_validate(events[-1][1]["response"])
    assert [item.type for item in streamed.output] == [item.type for item in whole.output]
    assert streamed.status == whole.status and streamed.usage.input_tokens_details.cache_write_tokens == 0


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}


UNANSWERED_CALL = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),  # built-in tools are not run here; functions are
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, IMAGE]}]},
            "input.0.content.1",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input.0"),  # no such call
        ({"input": [{"role": "user", "content": "Hi."}, UNANSWERED_CALL]}, "input.1"),  # no output answers it
        ({"input": [{"type": "item_reference", "id": "fc_1"}]}, "input.0"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),  # past the 1,024-token context
        ({"temperature": 2.5}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),  # not chat's field
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}}, "text.format"),
        ({"include": ["message.output_text.logprobs", "reasoning.summary"]}, "include"),  # not OpenAI's includable
        ({"include": "message.output_text.logprobs"}, "include"),  # a list
        ({"include": [OUTPUT_LOGPROBS], "top_logprobs": 21}, "top_logprobs"),  # OpenAI's 0 to 20
        ({"tools": [{"name": "f", "parameters": {"type": "object"}}]}, "tools.0.type"),  # OpenAI requires the type
        ({"tools": [WEATHER], "tool_choice": {"name": "get_weather"}}, "tool_choice.type"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        # OpenAI's limits: metadata of at most 16 pairs, keys of at most 64 characters, values of at most 512
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 65),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
    ],
)
def test_bad_requests_are_400_naming_the_field(server, client, model, change, param):
    body = {"model": model, "input": "Hi.", "max_output_tokens": 16} | change
    response = server.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**body)


def test_bookkeeping_fields_are_accepted(client, model):
    response = client.responses.create(
        model=model, input="Hi.", max_output_tokens=16, store=False, metadata={"k": "v"}, user="u",
        tool_choice="auto", truncation="disabled", stream=None,  # the client sends null: the default, as on chat
        prompt_cache_key="k", prompt_cache_retention="24h", reasoning={"effort": "xhigh"},  # OpenAI's newest level
        extra_body={"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    )  # fmt: skip
    assert response.metadata == {"k": "v"} and response.usage.output_tokens <= 16


def test_openai_limits_are_accepted_up_to_their_bounds(client, model):
    metadata = {f"{i:064}": "v" * 512 for i in range(16)}
    response = client.responses.create(model=model, input="Hi.", max_output_tokens=16, metadata=metadata)
    assert response.metadata == metadata and response.max_output_tokens == 16


def test_null_fields_the_clients_types_allow_are_left_out(client, model):
    """The client's FunctionToolParam allows a null description (as MCP tool lists have), parameters and strict."""
    tool = {"type": "function", "name": "get_weather"}

    def input_tokens(tools: list[dict]) -> int:
        return client.responses.create(model=model, input="Hi.", tools=tools, max_output_tokens=16).usage.input_tokens

    assert input_tokens([tool | {"description": None, "parameters": None, "strict": None}]) == input_tokens([tool])


def test_a_response_repeats_its_requests_fields_created_streamed_and_read_back(server, client, model):
    """As OpenAI's response does; those left out as their defaults (text as plain text, reasoning as none asked)."""
    first = client.responses.create(model=model, input="Hi.", max_output_tokens=16)
    asked = {
        "previous_response_id": first.id, "text": {"format": {"type": "json_object"}, "verbosity": "medium"},
        "reasoning": {"effort": "low", "summary": None}, "truncation": "disabled", "background": False,
        "user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
        "max_tool_calls": 3, "store": True, "metadata": {"k": "v"}, "instructions": INSTRUCTIONS,
        "max_output_tokens": 16, "temperature": 0.5, "top_p": 0.9, "parallel_tool_calls": False,
    }  # fmt: skip
    body = {"model": model, "input": "Again.", **asked}
    expected = asked | {"service_tier": "default"}  # the one tier this server has, whatever is asked
    created = server.post("/v1/responses", json=body | {"service_tier": "auto"}).json()
    assert {name: created[name] for name in expected} == expected
    read = server.get(f"/v1/responses/{created['id']}").json()
    assert {name: read[name] for name in expected} == expected
    events = server.events("/v1/responses", body | {"stream": True})
    for _, event in events:
        if "response" in event:
            assert {name: event["response"][name] for name in expected} == expected, event["type"]
    plain = client.responses.create(model=model, input="Hi.", max_output_tokens=16, store=False)
    assert plain.text.format.type == "text" and plain.reasoning.effort is None and plain.store is False
    assert plain.previous_response_id is None and plain.truncation == "disabled"


def test_only_a_background_response_can_be_cancelled(client, model):
    """As OpenAI answers: a response not created with background true (none is, here) is a 400; an id not kept
    is a 404, as on GET."""
    response = client.responses.create(model=model, input="Hi.", max_output_tokens=16)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.cancel(response.id)
    assert refused.value.body["message"] == "Cannot cancel a synchronous response."
    assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")


def test_listed_input_items_have_their_own_status(client, model):
    """An output item cut by the token limit is listed incomplete among the items a response continuing it was
    given; a status given with an input item is its own."""
    cut = client.responses.create(model=model, input="Write a long story.", max_output_tokens=16, temperature=0)
    assert cut.output[0].status == "incomplete"
    given = {"type": "message", "role": "assistant", "content": "An apple.", "status": "incomplete"}
    answer = client.responses.create(model=model, previous_response_id=cut.id, input=[given, TURNS[2]],
                                     max_output_tokens=16)  # fmt: skip
    items = list(client.responses.input_items.list(answer.id, order="asc"))
    assert [(item.role, item.status) for item in items] == [
        ("user", "completed"), ("assistant", "incomplete"), ("assistant", "incomplete"), ("user", "completed")
    ]  # fmt: skip
    assert items[1].id == cut.output[0].id


def test_a_refusal_given_back_is_the_assistant_text(client, model):
    """An assistant message's ``refusal`` part (OpenAI's ResponseOutputRefusal, sent back as input) is what the
    assistant said: the same prompt as that text in an ``output_text`` part."""

    def prompt_tokens(part: dict) -> int:
        turns = [TURNS[0], {"type": "message", "role": "assistant", "content": [part]}, TURNS[2]]
        return client.responses.create(model=model, input=turns, max_output_tokens=16).usage.input_tokens

    refusal = "I can't help with that."
    as_text = prompt_tokens({"type": "output_text", "text": refusal, "annotations": []})
    assert prompt_tokens({"type": "refusal", "refusal": refusal}) == as_text


def assert_same_logprobs(got: list[dict], expected: list[dict]) -> None:
    """The same tokens (each with its bytes and its alternatives'), the same values but for rounding (the prefix
    cache may have computed the prompt in other pieces)."""

    def tokens(logprobs: list[dict]) -> list:
        return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]) for e in logprobs]

    def values(logprobs: list[dict]) -> list[float]:
        return [value for e in logprobs for value in [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])]]

    assert tokens(got) == tokens(expected)
    assert values(got) == pytest.approx(values(expected), abs=1e-4)


def test_output_text_logprobs_are_the_chat_completions(server, client, model):
    """``include: ["message.output_text.logprobs"]``: the output_text part carries the chat completion's
    logprobs (same tokens, bytes, ``top_logprobs`` alternatives), streamed as each delta's tokens and whole in
    the done events."""
    response = client.responses.create(model=model, input=TURNS, max_output_tokens=16, temperature=0,
                                       include=[OUTPUT_LOGPROBS], top_logprobs=2)  # fmt: skip
    chat = client.chat.completions.create(model=model, messages=TURNS, max_tokens=16, temperature=0, logprobs=True,
                                          top_logprobs=2).choices[0]  # fmt: skip
    [part] = response.output[0].content
    expected = [entry.model_dump() for entry in chat.logprobs.content]
    assert_same_logprobs([entry.model_dump() for entry in part.logprobs], expected)
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs) and response.top_logprobs == 2
    assert bytes(b for entry in part.logprobs for b in entry.bytes).decode().startswith(part.text)
    body = {"model": model, "input": TURNS, "max_output_tokens": 16, "temperature": 0, "include": [OUTPUT_LOGPROBS],
            "top_logprobs": 2, "stream": True}  # fmt: skip
    events = [event for _, event in server.events("/v1/responses", body)]
    deltas = [entry for e in events if e["type"] == "response.output_text.delta" for entry in e["logprobs"]]
    [done] = [e["logprobs"] for e in events if e["type"] == "response.output_text.done"]
    streamed = Response.model_validate(events[-1]["response"]).output[0].content[0]
    assert done == [entry.model_dump() for entry in streamed.logprobs]
    assert_same_logprobs(done, expected)
    assert deltas == done[: len(deltas)] and len(deltas) >= len(done) - 1  # all but an end token's, if any
    without = client.responses.create(model=model, input=TURNS, max_output_tokens=16, temperature=0, top_logprobs=2)
    assert without.output[0].content[0].logprobs == [] and without.output_text == response.output_text


def test_includes_of_what_the_server_does_not_keep_are_accepted(client, model, whole):
    """What agent clients send (the Codex CLI and the Agents SDK: encrypted reasoning) and the outputs of hosted
    tools: accepted, changing nothing in the answer."""
    everything = typing.get_args(ResponseIncludable)
    response = client.responses.create(model=model, input=TURNS, max_output_tokens=16, temperature=0,
                                       include=[value for value in everything if value != OUTPUT_LOGPROBS])  # fmt: skip
    assert response.output_text == whole.output_text and response.output[0].content[0].logprobs == []


def test_an_unknown_include_is_named(server, model):
    body = {"model": model, "input": "Hi.", "include": [OUTPUT_LOGPROBS, "reasoning.summary"]}
    error = server.post("/v1/responses", json=body).json()["error"]
    assert error["param"] == "include" and "reasoning.summary" in error["message"]


def test_text_then_calls_accumulate_in_the_clients_stream_state():
    """An answer of reasoning, text and two calls (which a random model cannot be made to write through
    this route) as events, read by the official client's own stream accumulator."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    from xinfer.server.responses_api.answer import ItemStream
    from xinfer.server.responses_api.objects import Response

    events: list[dict] = []
    items = ItemStream(lambda kind, **fields: events.append({"type": kind, "sequence_number": len(events), **fields}))
    started = Response(id="resp_1", created_at=0, status="in_progress", model="m")
    items.event("response.created", response=started.model_dump())
    items.write("reasoning", "Hmm.")
    items.write("message", "Let me ")
    items.write("message", "check.")
    items.call("call_1", "get_weather")
    items.write("function_call", '{"city": ')
    items.write("function_call", '"Rome"}')
    items.call("call_2", "get_time")
    items.write("function_call", "{}")
    items.finish("completed")
    done = started.model_copy(update={"status": "completed", "output": items.items})
    items.event("response.completed", response=done.model_dump())
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    # the client checks each item done against the one added; its deltas carry what it accumulated
    for event in events:
        EVENT_TYPES[event["type"]].model_validate(event)
    read = [e for event in events for e in state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))]
    snapshots = {e.output_index: e.snapshot for e in read if e.type.endswith(".delta") and hasattr(e, "snapshot")}
    assert snapshots == {1: "Let me check.", 2: '{"city": "Rome"}', 3: "{}"}
    response = state._completed_response
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert [(i.call_id, i.name, i.arguments) for i in response.output[2:]] == [
        ("call_1", "get_weather", '{"city": "Rome"}'),
        ("call_2", "get_time", "{}"),
    ]
    assert response.output_text == "Let me check."


def test_previous_response_id_continues_its_conversation_without_its_instructions(client, model):
    """OpenAI's ``previous_response_id``: the response continued is given again (its input, then its output as the
    items a client would send back); its ``instructions`` are not carried over. Greedy, so the continuation is
    the answer to the whole conversation sent as items."""
    first = client.responses.create(model=model, input=TURNS[0]["content"], instructions=INSTRUCTIONS,
                                    max_output_tokens=16, temperature=0)  # fmt: skip
    second = client.responses.create(model=model, previous_response_id=first.id, input=TURNS[2]["content"],
                                     max_output_tokens=16, temperature=0)  # fmt: skip
    assert second.instructions is None
    spelled_out = [TURNS[0], {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
                   TURNS[2]]  # fmt: skip
    expected = client.responses.create(model=model, input=spelled_out, max_output_tokens=16, temperature=0)
    assert second.output_text == expected.output_text
    assert second.usage.input_tokens == expected.usage.input_tokens
    third = client.responses.create(model=model, previous_response_id=second.id, input="And a third?",
                                    max_output_tokens=16, temperature=0)  # fmt: skip
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens  # the chain, whole


def test_a_function_call_is_answered_by_continuing_its_response(client, model):
    """The Responses API's tool loop: the call's output sent with ``previous_response_id`` instead of the call."""
    called = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=30,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)  # fmt: skip
    [call] = [item for item in called.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = client.responses.create(model=model, previous_response_id=called.id, input=[output], tools=[WEATHER],
                                     max_output_tokens=16, temperature=0)  # fmt: skip
    given_back = [{"role": "user", "content": "Weather in Paris?"},
                  {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                  output]  # fmt: skip
    expected = client.responses.create(model=model, input=given_back, tools=[WEATHER], max_output_tokens=16,
                                       temperature=0)  # fmt: skip
    assert (answer.output_text, answer.usage.input_tokens) == (expected.output_text, expected.usage.input_tokens)


def test_kept_responses_are_read_back_and_deleted_and_store_false_keeps_none(client, model):
    streamed_id = ""
    with client.responses.stream(model=model, input="Hi.", max_output_tokens=16, temperature=0) as stream:
        for event in stream:
            if event.type == "response.created":
                streamed_id = event.response.id
    whole = client.responses.create(model=model, input="Hi.", max_output_tokens=16, temperature=0)
    read = client.responses.retrieve(whole.id)
    assert (read.id, read.status, read.output_text, read.usage) == (whole.id, whole.status, whole.output_text,
                                                                    whole.usage)  # fmt: skip
    streamed = client.responses.retrieve(streamed_id)  # kept at its end, as the one not streamed
    assert (streamed.status, streamed.output_text) == (whole.status, whole.output_text)
    client.responses.delete(whole.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(whole.id)
    with pytest.raises(openai.BadRequestError, match="previous response with id"):
        client.responses.create(model=model, previous_response_id=whole.id, input="Hi.", max_output_tokens=16)
    unkept = client.responses.create(model=model, input="Hi.", max_output_tokens=16, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_input_items_list_what_a_response_was_given_a_page_at_a_time(server, client, model):
    """``client.responses.input_items.list``: the items of the conversation continued, then the request's own, as
    the client's ``ResponseItem`` types, newest first unless ``order="asc"``; pages follow ``after``."""
    called = client.responses.create(model=model, input=[{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "Weather in Paris?"}],
                                     tools=[WEATHER], max_output_tokens=30,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)  # fmt: skip
    [call] = [item for item in called.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    answer = client.responses.create(model=model, previous_response_id=called.id, input=[output], tools=[WEATHER],
                                     max_output_tokens=16, temperature=0)  # fmt: skip
    items = list(client.responses.input_items.list(answer.id, order="asc"))
    assert [(item.type, getattr(item, "role", None)) for item in items] == [
        ("message", "system"), ("message", "user"), ("function_call", None), ("function_call_output", None)
    ]  # fmt: skip
    assert items[1].content[0].type == "input_text" and items[1].content[0].text == "Weather in Paris?"
    assert items[2].id == call.id and (items[2].call_id, items[2].arguments) == (call.call_id, call.arguments)
    assert items[3].call_id == call.call_id and items[3].output == "sunny"
    assert len({item.id for item in items}) == 4
    newest_first = list(client.responses.input_items.list(answer.id, limit=1))  # (the client follows the pages)
    assert [item.id for item in newest_first] == [item.id for item in reversed(items)]
    page = client.responses.input_items.list(answer.id, limit=3, order="asc")
    assert [item.id for item in page.data] == [item.id for item in items[:3]] and page.has_more
    assert [item.id for item in client.responses.input_items.list(called.id, order="asc")] == [i.id for i in items[:2]]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
    for query, param in [("limit=0", "limit"), ("order=up", "order"), ("after=msg_unknown", "after")]:
        response = server.get(f"/v1/responses/{answer.id}/input_items?{query}")
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_an_error_in_a_continued_response_names_the_requests_own_item(server, client, model):
    """Items are numbered within the request's ``input``; an unanswered call of the continued response is named by
    ``previous_response_id``."""
    called = client.responses.create(model=model, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=30,
                                     tool_choice={"type": "function", "name": "get_weather"}, temperature=0)  # fmt: skip
    base = {"model": model, "previous_response_id": called.id, "tools": [WEATHER], "max_output_tokens": 16}
    for given, param in [
        ("Thanks.", "previous_response_id"),  # the call is left unanswered
        ([{"type": "item_reference", "id": "x"}], "input.0"),
    ]:
        response = server.post("/v1/responses", json=base | {"input": given})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
