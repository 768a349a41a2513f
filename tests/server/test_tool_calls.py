"""Tool calling through the official ``openai`` client against a live server: a tiny random
Qwen3 with Qwen3's own chat template (tests/toolcalls/qwen3_chat_template.jinja, as the
model ships it) over SmolLM2's vocabulary. Random weights choose nothing, so answers are
held to grammars: ``tool_choice`` ``required`` and named functions by the server's own
grammar, and under ``auto`` an answer forced (by a regex) to be a call in Qwen's format,
which the server must read as one."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from transformers import Qwen3Config

from tests.server.live import LiveServer
from tests.tiny_models import save_tiny_model
from xinfer.loading.resolve import default_model_path
from xinfer.text.tokenizer import Tokenizer

TEMPLATE = Path(__file__).parents[1] / "toolcalls" / "qwen3_chat_template.jinja"
NO_THINKING = {"enable_thinking": False}
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for two days?"}]
# what Qwen3 writes for a call, held as a regex (the answer of a random model under auto)
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'


def escaped(text: str) -> str:
    return "".join("\\" + c if c in '{}[]().*+?|^$\\"' else c for c in text).replace("\n", "\\n")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-tools")
    backend = Tokenizer.from_gguf(default_model_path()).backend
    (folder / "tokenizer.json").write_text(backend.to_str())
    config = {"chat_template": TEMPLATE.read_text(), "eos_token": "<|im_end|>", "bos_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    save_tiny_model(
        Qwen3Config(vocab_size=backend.get_vocab_size(with_added_tokens=True), hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=2048, eos_token_id=backend.token_to_id("<|im_end|>"),
                    architectures=["Qwen3ForCausalLM"]),
        folder,
    )  # fmt: skip
    live = LiveServer("--m", str(folder), "--max-model-len", "2048", "--cpu", name="tiny-qwen3-tools").start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(qwen):
    return qwen.client(timeout=300)


def ask(client, stream: bool = False, **kwargs):
    kwargs.setdefault("messages", QUESTION)
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 120)
    extra = {"chat_template_kwargs": NO_THINKING, **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, stream=stream, extra_body=extra, **kwargs
    )


def checked_calls(message) -> list[tuple[str, dict]]:
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def collect(chunks) -> tuple[str, list[tuple[str, str, str]], str | None]:
    """Content, (id, name, arguments) of each call, and the finish reason of a streamed answer."""
    content, calls, reason = "", [], None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for piece in choice.delta.tool_calls or []:
            if piece.index == len(calls):
                assert piece.id and piece.type == "function" and piece.function.name, "a call's first piece names it"
                calls.append([piece.id, piece.function.name, piece.function.arguments or ""])
            else:
                assert piece.function.name is None
                calls[piece.index][2] += piece.function.arguments or ""
        reason = choice.finish_reason or reason
    return content, [tuple(c) for c in calls], reason


def test_required_call_follows_the_tools_schemas(client):
    answer = ask(client, tool_choice="required", parallel_tool_calls=False)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, _)] = checked_calls(choice.message)
    assert name in SCHEMAS


def test_required_calls_cut_by_max_tokens_are_text_whole_and_go_out_as_written_streamed(client):
    """A random model adds calls until max_tokens. Whole, output that is not complete calls is content, as vLLM's
    parsers answer it (hermes ``extract_tool_calls``: json.loads fails, tools_called=False); streamed, the calls
    went out as they were written, the finished ones following their schemas."""
    choice = ask(client, tool_choice="required", max_tokens=60).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('[{"name": ')
    content, calls, reason = collect(ask(client, stream=True, tool_choice="required", max_tokens=60))
    assert content == "" and reason == "length" and len(calls) > 1
    assert len({c[0] for c in calls}) == len(calls), "every call has its own id"
    for _, name, arguments in calls[:-1]:  # the last one is cut by max_tokens
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_named_function_is_called(client):
    """A named function's call finishes with ``stop``, as OpenAI's and vLLM's do (serving_chat's
    ``chat_completion_full_generator``: ``tool_calls`` for auto and required only)."""
    answer = ask(client, tool_choice={"type": "function", "function": {"name": "get_time"}})
    [(name, _)] = checked_calls(answer.choices[0].message)
    assert name == "get_time" and answer.choices[0].finish_reason == "stop"


def test_named_function_streams_like_the_whole_answer(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = ask(client, tool_choice=choice).choices[0].message.tool_calls[0].function
    content, calls, reason = collect(ask(client, stream=True, tool_choice=choice))
    assert content == "" and reason == "stop"  # vLLM's serving_chat: no tool_calls reason for a named function
    assert [(name, arguments) for _, name, arguments in calls] == [(whole.name, whole.arguments)]


def test_auto_reads_the_models_own_format_whole_and_streamed(client):
    extra = {"structured_outputs": {"regex": "Let me check\\.\\n" + escaped(HERMES_CALL)}}
    message = ask(client, tool_choice="auto", extra_body=extra).choices[0].message
    assert message.content == "Let me check.\n"  # the text before the call, as written (vLLM hermes)
    assert checked_calls(message) == [("get_weather", {"city": "Rome", "days": 2})]
    content, calls, reason = collect(ask(client, stream=True, tool_choice="auto", extra_body=extra))
    assert content == "Let me check.\n" and reason == "tool_calls"
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == [
        ("get_weather", {"city": "Rome", "days": 2})
    ]
    # the official client's own accumulation of the streamed deltas (which reads strict tools only)
    model, strict = (
        client.models.list().data[0].id,
        [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS],
    )
    with client.chat.completions.stream(model=model, messages=QUESTION, tools=strict, tool_choice="auto",
                                        temperature=0, extra_body=extra | {"chat_template_kwargs": NO_THINKING}) as stream:  # fmt: skip
        accumulated = stream.get_final_completion().choices[0]
    assert accumulated.message.content == "Let me check.\n" and accumulated.finish_reason == "tool_calls"
    assert checked_calls(accumulated.message) == [("get_weather", {"city": "Rome", "days": 2})]


def test_tool_choice_none_leaves_the_answer_as_text(client):
    extra = {"structured_outputs": {"regex": escaped(HERMES_CALL)}}
    choice = ask(client, tool_choice="none", extra_body=extra).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == HERMES_CALL
    assert choice.finish_reason == "stop"


def test_round_trip_through_the_template(qwen, client):
    """A call from the server, sent back with its result, renders as Qwen3 expects, and the model answers."""
    call = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls[0]
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    answer = ask(client, messages=messages, max_tokens=5)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(qwen.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    text = httpx.post(qwen.url + "/detokenize", json={"tokens": rendered}, timeout=60).json()["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments))
    expected_call = f'<tool_call>\n{{"name": "{call.function.name}", "arguments": {arguments}}}\n</tool_call>'
    assert expected_call in text
    assert '<|im_start|>user\n<tool_response>\n{"forecast": "sunny"}\n</tool_response><|im_end|>' in text


def test_tokenize_renders_tools_and_a_continued_message_as_the_chat_does(qwen, client):
    """/tokenize counts the prompt a chat completion runs: with the tools in it, and ending inside a final message."""
    prefill = [*QUESTION, {"role": "assistant", "content": "Let me see"}]
    cases = [
        (dict(messages=QUESTION, tools=TOOLS), {}),
        (dict(messages=prefill), {"add_generation_prompt": False, "continue_final_message": True}),
    ]
    for fields, flags in cases:
        body = {**fields, **flags, "chat_template_kwargs": NO_THINKING}
        tokens = httpx.post(qwen.url + "/tokenize", json=body, timeout=60).json()
        reply = ask(client, **{"tools": None, **fields, "max_tokens": 1, "extra_body": flags})
        assert tokens["count"] == reply.usage.prompt_tokens
    with_tools = httpx.post(qwen.url + "/tokenize", json={"messages": QUESTION, "tools": TOOLS}, timeout=60).json()
    text = httpx.post(qwen.url + "/detokenize", json={"tokens": with_tools["tokens"]}, timeout=60).json()["prompt"]
    assert '"name": "get_weather"' in text


def test_history_calls_whose_arguments_are_not_json_go_back_as_sent(qwen, client):
    """OpenAI takes a call's arguments as any string (its reference: the model may write invalid JSON) and null
    content beside tool_calls: they render through the template as the client sent them."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "unknown city"},
    ]
    answer = ask(client, messages=messages, tool_choice="none", max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")
    rendered = httpx.post(qwen.url + "/tokenize", json={"messages": messages}, timeout=60).json()["tokens"]
    text = httpx.post(qwen.url + "/detokenize", json={"tokens": rendered}, timeout=60).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}\n</tool_call>' in text


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, "parameters"),
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "name"),
        ({"tools": [{"type": "retrieval"}]}, "type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
        ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "missing"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "required"),
    ],
)
def test_bad_tools_are_400(client, kwargs, named):
    if kwargs.get("tools", "") is None:
        kwargs = {**kwargs, "tools": openai.omit}
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, **kwargs)
    assert error.value.status_code == 400 and named in error.value.message


ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}  # fmt: skip
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}], ids=["required", "named"]
)
def test_a_forced_call_with_response_format_is_the_call(client, tool_choice):
    """OpenAI takes both: the forced call is the answer (its arguments follow its tool's schema) and the format
    would govern the message's text, which the answer has none of."""
    alone = ask(client, tool_choice=tool_choice, parallel_tool_calls=False).choices[0]
    both = ask(client, tool_choice=tool_choice, parallel_tool_calls=False, response_format=ANSWER_FORMAT).choices[0]
    reason = "stop" if isinstance(tool_choice, dict) else "tool_calls"  # vLLM's serving_chat, as OpenAI
    assert both.finish_reason == reason and both.message.content is None
    assert checked_calls(both.message) == checked_calls(alone.message)
    streamed = ask(
        client, stream=True, tool_choice=tool_choice, parallel_tool_calls=False, response_format=ANSWER_FORMAT
    )
    content, calls, streamed_reason = collect(streamed)
    assert content == "" and streamed_reason == reason
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == checked_calls(alone.message)


def test_auto_with_response_format_holds_a_text_answer_to_it(client):
    """A random model answers in text: its content is held to the format, the tools offered beside it."""
    message = ask(client, tool_choice="auto", response_format=ANSWER_FORMAT, max_tokens=30).choices[0].message
    assert message.tool_calls is None
    jsonschema.validate(json.loads(message.content), ANSWER)


def test_a_forced_call_with_structured_outputs_is_400(client):
    """vLLM's structured_outputs constrains the whole answer, which a forced call already is."""
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, tool_choice="required", extra_body={"structured_outputs": {"regex": "[a-z]+"}})
    assert error.value.body["param"] == "structured_outputs" and "tool_choice" in error.value.message


def test_the_messages_api_calls_tools_and_sends_results_back(qwen, client):
    """Through the official anthropic client: a required call is a tool_use block; the call and its result
    sent back as Anthropic blocks render through Qwen3's template as the OpenAI conversation does."""
    import anthropic

    claude = anthropic.Anthropic(base_url=qwen.url, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    message = claude.messages.create(
        model=model, max_tokens=60, messages=QUESTION, tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body={"temperature": 0},
    )  # fmt: skip
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMAS[use.name])
    anthropic_turns = [
        *QUESTION,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": '{"forecast": "sunny"}'}],
        },
    ]
    call = {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}
    openai_turns = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": '{"forecast": "sunny"}'},
    ]
    counted = claude.messages.count_tokens(model=model, messages=anthropic_turns, tools=tools)
    expected = client.chat.completions.create(model=model, messages=openai_turns, tools=TOOLS, max_tokens=1)
    assert counted.input_tokens == expected.usage.prompt_tokens


def test_the_messages_api_streams_a_call_in_tool_use_pieces(qwen, client):
    """Streamed through the official anthropic client: a forced call streams as a tool_use block whose input
    comes in one input_json_delta once the call proved a valid object (the client raises on input that is not
    JSON), and the events accumulate to the whole answer."""
    import anthropic

    claude = anthropic.Anthropic(base_url=qwen.url, api_key="unused", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]  # fmt: skip
    kwargs = dict(model=client.models.list().data[0].id, max_tokens=60, messages=QUESTION, tools=tools,
                  thinking={"type": "disabled"}, tool_choice={"type": "tool", "name": "get_weather"},
                  extra_body={"temperature": 0})  # fmt: skip
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    without_ids = [b.model_dump(exclude={"id"}) for b in whole.content]
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == without_ids
    assert [b.type for b in whole.content] == ["tool_use"] and whole.content[0].name == "get_weather"
    jsonschema.validate(whole.content[0].input, WEATHER)
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    json_pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert [json.loads(piece) for piece in json_pieces] == [whole.content[0].input]


def test_the_messages_api_gives_a_forced_call_cut_by_max_tokens_as_the_client_reads_its_stream(qwen, client):
    """A forced tool's call cut by max_tokens is an incomplete tool_use block (stop_reason max_tokens, as Anthropic
    documents it), its input what the cut arguments hold: their partial-JSON parse, which Anthropic's client makes of
    a cut stream. Whole and streamed alike; the stream's input_json_delta is that object (valid JSON)."""
    import anthropic
    import pydantic_core

    claude = anthropic.Anthropic(base_url=qwen.url, api_key="unused", max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    kwargs = dict(model=client.models.list().data[0].id, max_tokens=8, messages=QUESTION, tools=tools,
                  thinking={"type": "disabled"}, tool_choice={"type": "tool", "name": "get_weather"},
                  extra_body={"temperature": 0})  # fmt: skip
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        pieces = [event.partial_json for event in stream if event.type == "input_json"]
        streamed = stream.get_final_message()
    cut = ask(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=8).choices[0]
    arguments = cut.message.tool_calls[0].function.arguments  # chat's arguments are the cut text, as vLLM's
    assert cut.finish_reason == "length" and not arguments.endswith("}")
    [use] = whole.content
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    assert (use.type, use.name) == ("tool_use", "get_weather") and use.input
    assert use.input == pydantic_core.from_json(arguments, allow_partial=True)
    assert [b.model_dump(exclude={"id"}) for b in streamed.content] == [use.model_dump(exclude={"id"})]
    assert [json.loads(piece) for piece in pieces] == [use.input]


# OpenAI's Responses API: the same tools, flat ({"type": "function", "name": ...}), and the same answers
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
NO_REASONING = {"effort": "none"}


def respond(client, **kwargs):
    kwargs.setdefault("input", QUESTION)
    kwargs.setdefault("tools", RESPONSES_TOOLS)
    kwargs.setdefault("max_output_tokens", 120)
    return client.responses.create(
        model=client.models.list().data[0].id, temperature=0, reasoning=NO_REASONING, **kwargs
    )


def test_responses_call_is_a_function_call_item_whole_and_streamed(client):
    response = respond(client, tool_choice="required", parallel_tool_calls=False)
    chat = ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message.tool_calls[0]
    [call] = response.output
    assert call.type == "function_call" and call.id.startswith("fc_") and call.call_id and call.status == "completed"
    assert (call.name, call.arguments) == (chat.function.name, chat.function.arguments)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert response.status == "completed" and response.output_text == ""
    assert response.tool_choice == "required" and response.parallel_tool_calls is False
    assert [t.name for t in response.tools] == ["get_weather", "get_time"]
    # the client's stream helper checks the events' order and the items' identities as it accumulates them
    with client.responses.stream(model=client.models.list().data[0].id, input=QUESTION, tools=RESPONSES_TOOLS,
                                 tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                                 temperature=0, reasoning=NO_REASONING) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"} and len(deltas) > 1
    [streamed] = final.output
    assert streamed.type == "function_call" and (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert "".join(deltas) == streamed.arguments and streamed.call_id and streamed.status == "completed"


def test_responses_calls_cut_by_the_token_limit_are_chats(client):
    """A random model adds calls until the token limit: an incomplete response. Whole, the cut output is a message
    (chat's content: vLLM answers output it cannot read as calls as text); streamed, the calls went out as written."""
    response = respond(client, tool_choice="required", max_output_tokens=40)
    with client.responses.stream(model=client.models.list().data[0].id, input=QUESTION, tools=RESPONSES_TOOLS,
                                 tool_choice="required", max_output_tokens=40, temperature=0,
                                 reasoning=NO_REASONING) as stream:  # fmt: skip
        final = list(stream)[-1].response  # get_final_response() takes a completed response only
    chat = ask(client, tool_choice="required", max_tokens=40).choices[0].message
    assert response.status == final.status == "incomplete"
    assert [i.type for i in response.output] == ["message"] and response.output_text == chat.content
    _, streamed, _ = collect(ask(client, stream=True, tool_choice="required", max_tokens=40))
    assert [(i.name, i.arguments) for i in final.output] == [(name, arguments) for _, name, arguments in streamed]
    assert len({i.call_id for i in final.output}) == len(final.output)


def test_responses_named_function_and_none(client):
    response = respond(client, tool_choice={"type": "function", "name": "get_time"})
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), TIME)
    assert response.tool_choice.type == "function" and response.tool_choice.name == "get_time"
    # none: the template is not told of the tools, and the answer is text as chat's is
    text = respond(client, tool_choice="none", max_output_tokens=16)
    chat = ask(client, tool_choice="none", max_tokens=16).choices[0].message
    assert [item.type for item in text.output] == ["message"] and text.output_text == chat.content
    assert text.usage.input_tokens == ask(client, tool_choice="none", max_tokens=16).usage.prompt_tokens


def test_responses_round_trip_with_function_call_output(client):
    """The output given back with the call's result renders as the chat conversation with the call and its
    tool message does (same prompt tokens, same answer)."""
    response = respond(client, tool_choice="required", parallel_tool_calls=False)
    [call] = response.output
    result = '{"forecast": "sunny"}'
    followed = respond(client, input=[*QUESTION, *response.output,
                                      {"type": "function_call_output", "call_id": call.call_id, "output": result}],
                       max_output_tokens=16)  # fmt: skip
    chat_call = {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [chat_call]},
                {"role": "tool", "tool_call_id": call.call_id, "content": result}]  # fmt: skip
    chat = ask(client, messages=messages, max_tokens=16)
    assert followed.usage.input_tokens == chat.usage.prompt_tokens
    assert followed.output_text == chat.choices[0].message.content and followed.output[-1].type == "message"


def test_responses_forced_call_with_text_format_is_the_call(client):
    """As on chat completions: the forced call is the answer; under auto a text answer is held to the format."""
    text = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
    named = {"type": "function", "name": "get_time"}
    alone = respond(client, tool_choice=named)
    both = respond(client, tool_choice=named, text=text)
    assert [(i.type, i.name, i.arguments) for i in both.output] == [(i.type, i.name, i.arguments) for i in alone.output]
    assert both.output[0].type == "function_call" and both.status == "completed"
    auto = respond(client, tool_choice="auto", text=text, max_output_tokens=30)
    assert [item.type for item in auto.output] == ["message"]
    jsonschema.validate(json.loads(auto.output_text), ANSWER)


@pytest.mark.parametrize(
    ("change", "param", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools", "file_search"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools", "name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "foo"}}]}, "tools", "parameters"),
        ({"tool_choice": {"type": "function", "name": "missing"}}, "tool_choice", "missing"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
        ({"tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "input.0", "call_id"),
    ],
)
def test_responses_bad_tools_are_400(qwen, client, change, param, named):
    body = {"model": client.models.list().data[0].id, "input": "Hi.", "tools": RESPONSES_TOOLS} | change
    response = httpx.post(qwen.url + "/v1/responses", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and named in error["message"]
