"""What a chat request's tools become before and after the model: the flag that picks the
parser, the checks that make bad tools a 400, the grammar a forced call is held to, and
assistant calls rendered back through a template that writes arguments with ``tojson``
(Llama's and Mistral's do)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import pytest

from xinfer.server.args import parse_args
from xinfer.server.prompts import render_chat
from xinfer.server.protocol import ChatCompletionRequest, ChatMessage
from xinfer.server.tools import forced_schema, tool_use
from xinfer.text.chat_template import ChatTemplate
from xinfer.toolcalls import FAMILIES, NamedFunctionParser, RequiredCallsParser

TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    },
    {"type": "function", "function": {"name": "g"}},
]


def test_enforce_parser_flag_takes_every_family_and_refuses_others(capsys):
    assert parse_args([]).enforce_parser == "auto"
    assert parse_args(["--enforce-parser", "qwen3_coder"]).enforce_parser == "qwen3_coder"
    with pytest.raises(SystemExit):
        parse_args(["--enforce-parser", "no_such_format"])
    assert "no_such_format" in capsys.readouterr().err


def test_tool_choice_picks_the_parser():
    assert tool_use(TOOLS, "none", None, FAMILIES["hermes"]).parser is None
    assert tool_use(TOOLS, "none", None, FAMILIES["hermes"]).template_tools is None
    assert isinstance(tool_use(TOOLS, "auto", None, FAMILIES["hermes"]).parser, FAMILIES["hermes"])
    assert isinstance(tool_use(TOOLS, None, None, FAMILIES["glm45"]).parser, FAMILIES["glm45"])
    assert isinstance(tool_use(TOOLS, "required", False, None).parser, RequiredCallsParser)
    named = tool_use(TOOLS, {"type": "function", "function": {"name": "g"}}, None, None)
    assert isinstance(named.parser, NamedFunctionParser) and named.template_tools == TOOLS
    assert tool_use(None, "auto", None, FAMILIES["hermes"]).parser is None


def test_forced_schemas_accept_calls_and_refuse_others():
    one = forced_schema(TOOLS, "required", False)
    jsonschema.validate([{"name": "f", "parameters": {"a": 1}}], one)
    for wrong in ([], [{"name": "h", "parameters": {}}], [{"name": "g", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, one)
    jsonschema.validate([{"name": "g", "parameters": {}}] * 2, forced_schema(TOOLS, "required", True))
    assert (
        forced_schema(TOOLS, {"type": "function", "function": {"name": "f"}}, None)
        == TOOLS[0]["function"]["parameters"]
    )
    assert forced_schema(TOOLS, "auto", None) is None


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
                ]
            },
            "properties",
        ),
        ({"tools": [*TOOLS, TOOLS[0]]}, "twice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "zz"}}}, "zz"),
        ({"tool_choice": "required"}, "needs tools"),
    ],
)
def test_bad_tools_are_refused_naming_the_problem(fields, problem):
    with pytest.raises(ValueError, match=problem):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_assistant_calls_render_with_arguments_as_objects():
    template = ChatTemplate(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.name }}:{{ c.function.arguments | tojson }};{% endfor %}[{{ m.content }}]{% endfor %}",
        "test",
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="2", tool_call_id="call_1"),
    ]
    text = render_chat(SimpleNamespace(chat_template_for=lambda tools: template), messages, add_generation_prompt=False)
    assert text == '[hi]f:{"a": 1};[][2]', "arguments once encoded, and null content as text"
    assert json.loads(call["function"]["arguments"]) == {"a": 1}  # the request's own message is left as it was


def test_templates_that_join_arguments_as_text_get_them_as_sent():
    template = ChatTemplate(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ '<call>' + c.function.name + ' ' + c.function.arguments }}{% endfor %}{% endfor %}",
        "test",
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content=None, tool_calls=[call])]
    text = render_chat(SimpleNamespace(chat_template_for=lambda tools: template), messages, add_generation_prompt=False)
    assert text == '<call>f {"a":1}'
