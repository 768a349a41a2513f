"""Outputs that vLLM's tool parsers do not read as calls (malformed, cut off, or text around a call):
the whole answer is text, streams never let out more than the whole answer holds where they can
know it, and the content is what vLLM's ``extract_tool_calls`` returns."""

from __future__ import annotations

import json

import pytest

from xinfer.toolcalls import ToolParser, parser_for

TB, TE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # noqa: RUF001
CB, CE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"  # noqa: RUF001

# vLLM's hermes, deepseekv3/v31, mistral and llama ``extract_tool_calls`` answer these with
# tools_called=False and the whole output as content (json.loads or raw_decode fails)
MALFORMED = {
    "hermes trailing comma": ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),
    "hermes text after the object": ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}} x\n</tool_call>'),
    "deepseek v3.1 not JSON": ("deepseek_v3", f"{TB}{CB}f{SEP}{{bad}}{CE}{TE}"),
    "mistral trailing comma": ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1,}}]'),
    "llama3 trailing comma": ("llama3_json", '{"name": "f", "parameters": {"a": 1,}}'),
    "hermes unclosed string swallows later calls": (
        "hermes",
        '<tool_call>\n{"name": "f", "arguments": {"a": "x}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\nMore text.',
    ),
    "llama3 text after the call": ("llama3_json", '{"name": "f", "parameters": {"a": 1}} Let me know!'),
    "pythonic positional argument": ("pythonic", '[get_weather("Paris")]'),
    "pythonic text after the list": ("pythonic", "[f(a=1)] and more"),
}
# cut by max_tokens: vLLM's json.loads / ast.parse / regex of a whole call fails
CUT = {
    "hermes in a value": ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "hel'),
    "hermes in the arguments key": ("hermes", '<tool_call>\n{"name": "f", "argu'),
    "llama3 in a value": ("llama3_json", '{"name": "f", "parameters": {"a": "x'),
    "pythonic second call": ("pythonic", '[f(a=1), g(s="x'),
    "glm in a started parameter": ("glm45", "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>hel"),
    "deepseek v3 before the fence": ("deepseek_v3", f"{TB}{CB}function{SEP}f\n"),
}


def streamed(parser: ToolParser, pieces: list[str], hold: bool = False) -> tuple[str, list[tuple[str, str]]]:
    stream = parser.stream(hold)
    deltas = [stream.push(piece) for piece in pieces] + [stream.finish()]
    calls: list[list[str]] = []
    for piece in (p for d in deltas for p in d.tool_calls):
        if piece.index == len(calls):
            calls.append([piece.name or "", ""])
        calls[piece.index][1] += piece.arguments
    return "".join(d.content for d in deltas), [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize("case", [*MALFORMED, *CUT])
def test_malformed_or_cut_calls_are_the_answers_text(case):
    """vLLM ``extract_tool_calls`` (hermes, deepseekv3, mistral, llama, pythonic, glm4_moe): tools_called=False,
    content the whole output."""
    name, text = {**MALFORMED, **CUT}[case]
    parsed = parser_for(name)().parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


@pytest.mark.parametrize("case", [*MALFORMED, *CUT])
def test_a_held_stream_lets_out_only_calls_that_proved_valid(case):
    """What the Messages API streams (a tool_use input must be an object): such output is text there too."""
    name, text = {**MALFORMED, **CUT}[case]
    for pieces in ([text], list(text)):
        assert streamed(parser_for(name)(), pieces, hold=True) == (text, [])


@pytest.mark.parametrize("case", ["llama3 text after the call", "pythonic positional argument"])
def test_a_start_marker_that_may_be_text_streams_as_the_whole_answer(case):
    """vLLM's llama and pythonic ``extract_tool_calls`` answer these as content: a stream that began with
    ``{`` or ``[`` holds the block until the output ends, so that it does not report a call either."""
    name, text = MALFORMED[case]
    assert streamed(parser_for(name)(), list(text)) == (text, [])


def test_streamed_calls_of_a_well_formed_output_stay_well_formed_pieces():
    """A stream lets out what it parsed (as vLLM's streaming parsers): every streamed call of a well formed
    output is a JSON object, and the text after the calls is no content."""
    text = 'Hi.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>\nDone.'
    content, calls = streamed(parser_for("hermes")(), list(text))
    assert content == "Hi.\n" and [(n, json.loads(a)) for n, a in calls] == [("f", {"a": [1, 2]})]


@pytest.mark.parametrize(
    ("name", "text", "content"),
    [
        (
            "hermes",
            'Let me check.\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nDone.',
            "Let me check.\n\n",
        ),
        ("deepseek_v3", f"Hi{TB}{CB}f{SEP}{{}}{CE}{TE} after", "Hi"),
        ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=s>\nx </tool_call> y\n</parameter>\n</tool_call>", None),
    ],
)
def test_content_is_the_text_before_the_first_call_as_written(name, text, content):
    """vLLM hermes / deepseekv3 / qwen3coder ``extract_tool_calls``: content = model_output[:first start marker]
    (None where empty); text after the calls is not content, nor markup of a call."""
    parsed = parser_for(name)().parse(text)
    assert parsed.content == content and [c.name for c in parsed.tool_calls] == ["f"]
    assert streamed(parser_for(name)(), list(text))[0] == (content or "")


def test_a_held_stream_sends_each_call_whole_once_its_block_closed():
    stream = parser_for("hermes")().stream(hold=True)
    assert stream.push('<tool_call>\n{"name": "f", "arguments": {"a": ').tool_calls == []
    [piece] = stream.push("1}}\n</tool_call>").tool_calls
    assert (piece.name, piece.arguments) == ("f", '{"a": 1}')


@pytest.mark.parametrize(("alias", "family"), [("deepseek_v32", "deepseek_v32"), ("minimax", "minimax")])
def test_vllms_parser_names_read_their_own_formats(alias, family):
    """vLLM's ``deepseek_v32`` reads DSML calls and its ``minimax`` MiniMax-M1's ``<tool_calls>`` lines."""
    assert parser_for(alias).name == family
    assert parser_for("minimax_m2").name == "minimax_m2"
