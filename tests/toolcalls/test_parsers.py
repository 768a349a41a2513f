"""Every family's tool-call parser on outputs written by hand in the format its chat template
renders (and its system prompt asks for), whole and streamed: cut at every position, and
one character at a time, the deltas concatenate to the whole output's parse."""

from __future__ import annotations

import json

import pytest

from xinfer.toolcalls import FAMILIES, PARSERS, NamedFunctionParser, RequiredCallsParser, ToolParser, detect, parser_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array", "items": {"type": "integer"}},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}},
        },
    },
]

TB, TE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # noqa: RUF001
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"  # noqa: RUF001

# (parser, output, expected content, expected calls as (name, arguments))
CASES = {
    "hermes two calls after text": (
        "hermes",
        'I will look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
        '</tool_call>\n<tool_call>\n{"name": "write_file", "arguments": {"path": "a.txt", "text": "x </tool_call> y"}}'
        "\n</tool_call>",
        "I will look that up.\n\n",
        [("get_weather", {"city": "Paris", "days": 3}), ("write_file", {"path": "a.txt", "text": "x </tool_call> y"})],
    ),
    "hermes plain answer": ("hermes", "Paris is sunny today.\n", "Paris is sunny today.\n", []),
    "hermes arguments as a JSON string": (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    "hermes text after the call is not content": (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n\nDone.',
        None,
        [("get_weather", {})],
    ),
    "hermes broken block is text": (
        "hermes",
        "Use <tool_call> tags like this.",
        "Use <tool_call> tags like this.",
        [],
    ),
    "qwen3 coder": (
        "qwen3_coder",
        "Writing it now.\n<tool_call>\n<function=write_file>\n<parameter=path>\nnotes/a.md\n</parameter>\n"
        "<parameter=text>\n# Title\n\nline one\nline two\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
        "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>",
        "Writing it now.\n",
        [
            ("write_file", {"path": "notes/a.md", "text": "# Title\n\nline one\nline two"}),
            ("get_weather", {"city": "Rome", "days": 2, "metric": True, "hours": [9, 12]}),
        ],
    ),
    "qwen3 coder string that looks like a number": (
        "qwen3_coder",
        "<tool_call>\n<function=write_file>\n<parameter=path>\n42\n</parameter>\n</function>\n</tool_call>",
        None,
        [("write_file", {"path": "42"})],
    ),
    "llama3 json": (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Lima", "days": 1}}',
        None,
        [("get_weather", {"city": "Lima", "days": 1})],
    ),
    "llama3 python tag, two calls": (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}; '
        '{"name": "write_file", "parameters": {"path": "b", "text": "{;}"}}',
        None,
        [("get_weather", {"city": "Lima"}), ("write_file", {"path": "b", "text": "{;}"})],
    ),
    "llama3 plain answer": ("llama3_json", "  It is 20 degrees.", "  It is 20 degrees.", []),
    "llama3 json that is not a call": ("llama3_json", '{"city": "Lima"}', '{"city": "Lima"}', []),
    "mistral v3 list": (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Bern"}}, '
        '{"name": "write_file", "arguments": {"path": "c", "text": "]"}}]',
        None,
        [("get_weather", {"city": "Bern"}), ("write_file", {"path": "c", "text": "]"})],
    ),
    "mistral v11": (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Bern", "days": 2}[TOOL_CALLS]write_file[ARGS]{"path": "d"}',
        "Sure.",
        [("get_weather", {"city": "Bern", "days": 2}), ("write_file", {"path": "d"})],
    ),
    "mistral call id": (
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Bern"}',
        None,
        [("get_weather", {"city": "Bern"})],
    ),
    "deepseek v3": (
        "deepseek_v3",
        f'Checking.{TB}{CB}function{SEP}get_weather\n```json\n{{"city": "Kyiv"}}\n```{CE}\n'
        f'{CB}function{SEP}write_file\n```json\n{{"path": "e", "text": "```"}}\n```{CE}{TE}',
        "Checking.",
        [("get_weather", {"city": "Kyiv"}), ("write_file", {"path": "e", "text": "```"})],
    ),
    "deepseek v3.1": (
        "deepseek_v3",
        f'{TB}{CB}get_weather{SEP}{{"city": "Kyiv", "days": 4}}{CE}{CB}write_file{SEP}{{"path": "f"}}{CE}{TE}',
        None,
        [("get_weather", {"city": "Kyiv", "days": 4}), ("write_file", {"path": "f"})],
    ),
    "glm 4.5": (
        "glm45",
        "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Hanoi</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
        "Let me check.\n",
        [("get_weather", {"city": "Hanoi", "days": 5})],
    ),
    "glm 4.7": (
        "glm45",
        "<tool_call>write_file<arg_key>path</arg_key><arg_value>g.py</arg_value><arg_key>text</arg_key>"
        "<arg_value>print(1)\n</arg_value></tool_call><tool_call>get_weather<arg_key>hours</arg_key>"
        "<arg_value>[1, 2]</arg_value></tool_call>",
        None,
        [("write_file", {"path": "g.py", "text": "print(1)\n"}), ("get_weather", {"hours": [1, 2]})],
    ),
    "minimax m2": (
        "minimax_m2",
        'Let me help.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Quito</parameter>\n'
        '<parameter name="days">7</parameter>\n</invoke>\n<invoke name="write_file">\n'
        '<parameter name="path">h</parameter>\n<parameter name="text">a\nb</parameter>\n</invoke>\n'
        "</minimax:tool_call>",
        "Let me help.\n",
        [("get_weather", {"city": "Quito", "days": 7}), ("write_file", {"path": "h", "text": "a\nb"})],
    ),
    "pythonic": (
        "pythonic",
        "[get_weather(city='Cairo', days=2, metric=False), write_file(path=\"i\", text='f(x), [y]')]",
        None,
        [
            ("get_weather", {"city": "Cairo", "days": 2, "metric": False}),
            ("write_file", {"path": "i", "text": "f(x), [y]"}),
        ],
    ),
    "pythonic llama 4": (
        "pythonic",
        "<|python_start|>[get_weather(hours=[1, 2])]<|python_end|>",
        None,
        [("get_weather", {"hours": [1, 2]})],
    ),
    "pythonic plain list is text": ("pythonic", "[1] is a footnote.", "[1] is a footnote.", []),
    "qwen3 coder end tag inside a value": (
        "qwen3_coder",
        "<tool_call>\n<function=write_file>\n<parameter=text>\nx </tool_call> y\n</parameter>\n</function>\n</tool_call>",
        None,
        [("write_file", {"text": "x </tool_call> y"})],
    ),
    "deepseek v3.2": (
        "deepseek_v32",
        'Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'  # noqa: RUF001
        '<｜DSML｜parameter name="city" string="true">2</｜DSML｜parameter>\n'  # noqa: RUF001
        '<｜DSML｜parameter name="hours" string="false">[1, 2]</｜DSML｜parameter>\n</｜DSML｜invoke>\n'  # noqa: RUF001
        '<｜DSML｜invoke name="write_file">\n<｜DSML｜parameter name="path" string="true">j</｜DSML｜parameter>\n'  # noqa: RUF001
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>",  # noqa: RUF001
        "Let me check.\n\n",
        [("get_weather", {"city": "2", "hours": [1, 2]}), ("write_file", {"path": "j"})],
    ),
    "minimax m1": (
        "minimax",
        'I will check.\n<tool_calls>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
        '{"name": "write_file", "arguments": {"path": "k", "text": "}"}}\n</tool_calls>',
        "I will check.\n",
        [("get_weather", {"city": "Lima"}), ("write_file", {"path": "k", "text": "}"})],
    ),
}


def whole(parser: ToolParser, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    parsed = parser.parse(text)
    return parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments text) of each call, from the deltas of ``pieces``."""
    stream = parser.stream()
    deltas = [stream.push(piece) for piece in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[list[str]] = []
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.index == len(calls):
                assert piece.id and piece.name, "a call's first delta names it"
                calls.append([piece.name, ""])
            else:
                assert piece.id is None and piece.name is None and piece.index < len(calls)
            calls[piece.index][1] += piece.arguments
    return content, [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize("case", list(CASES))
def test_whole_output(case):
    name, text, content, calls = CASES[case]
    assert whole(parser_for(name)(TOOLS), text) == (content, calls)


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_at_every_cut_equals_whole(case):
    name, text, _, _ = CASES[case]
    parser = parser_for(name)(TOOLS)
    parsed = parser.parse(text)
    expected = (parsed.content or "", [(c.name, c.arguments) for c in parsed.tool_calls])
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == expected, f"cut at {cut}: {text[:cut]!r}"
    assert streamed(parser, list(text)) == expected, "one character at a time"


def test_call_ids_are_unique_and_mistral_ids_have_nine_characters():
    parsed = parser_for("mistral")(TOOLS).parse(CASES["mistral v11"][1])
    assert [len(c.id) for c in parsed.tool_calls] == [9, 9] and parsed.tool_calls[0].id != parsed.tool_calls[1].id
    hermes = parser_for("hermes")(TOOLS).parse(CASES["hermes two calls after text"][1])
    assert len({c.id for c in hermes.tool_calls}) == 2


def test_arguments_stream_before_the_call_ends():
    stream = parser_for("hermes")(TOOLS).stream()
    first = stream.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", '{"city": "Par')]
    assert [d.arguments for d in stream.push('is"}}\n</tool_call>').tool_calls] == ['is"}']


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{{ '<tool_call>\\n' + tool_call.arguments | tojson + '\\n</tool_call>' }}", "hermes"),
        ("<tool_call>\\n<function=' ~ tool_call.name ~ '>", "qwen3_coder"),
        ("<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key>", "glm45"),
        ("'<minimax:tool_call>' ~ '<invoke name=\"'", "minimax_m2"),
        ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}", "deepseek_v3"),  # noqa: RUF001
        ("{{ '[TOOL_CALLS]' }}", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ("{{- '<|python_start|>' }}", "pythonic"),
        ("{{ '<｜DSML｜function_calls>\\n<｜DSML｜invoke name=\"' }}", "deepseek_v32"),  # noqa: RUF001
        ("{{ '<tool_calls>\\n' + tool_call | tojson + '\\n</tool_calls>' }}", "minimax"),
    ],
)
def test_parser_detected_from_the_chat_template(source, expected):
    assert detect(source) is FAMILIES[expected]


def test_no_parser_for_a_template_without_tool_calls():
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_every_listed_name_has_a_parser():
    assert all(issubclass(parser_for(name), ToolParser) for name in PARSERS)


FORCED = {
    "named": (
        NamedFunctionParser("get_weather", TOOLS),
        '{"city": "Oslo", "days": 2}',
        [("get_weather", {"city": "Oslo", "days": 2})],
    ),
    "required": (
        RequiredCallsParser(TOOLS),
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "write_file", "parameters": {}}]',
        [("get_weather", {"city": "Oslo"}), ("write_file", {})],
    ),
}


@pytest.mark.parametrize("case", list(FORCED))
def test_forced_calls_whole_and_streamed(case):
    parser, text, calls = FORCED[case]
    assert whole(parser, text) == (None, calls)
    expected = ("", [(name, json.dumps(arguments)) for name, arguments in calls])
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == expected


def test_a_named_call_opens_with_the_answers_first_text():
    """A reasoning model's answer text is empty until its reasoning ends (the chat stream pushes ``""``): the named
    function's call opens with its arguments' first text, after the reasoning, as vLLM's serving_chat sends it."""
    stream = NamedFunctionParser("get_weather", TOOLS).stream()
    assert stream.push("").tool_calls == [] and stream.push("\n\n").tool_calls == []
    [call] = stream.push('{"city": "Oslo"').tool_calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", '{"city": "Oslo"')
    cut = NamedFunctionParser("get_weather", TOOLS).stream()  # the reasoning cut by the token limit: a call still
    assert cut.push("").tool_calls == []
    assert [(c.name, c.arguments) for c in cut.finish().tool_calls] == [("get_weather", "")]
