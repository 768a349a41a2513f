"""The tool calls in an answer's text, read by the request's tool parser."""

from __future__ import annotations

from xinfer.server.chat_run import ChatPrompt
from xinfer.server.tools import Call, calls_given


def read_calls(prompt: ChatPrompt, text: str) -> tuple[str, list[Call]]:
    """(the answer's text without its calls, the calls: only the first where parallel calls are off); all
    text where the request's parser finds none."""
    parser = prompt.tool_parser
    if parser is None:
        return text, []
    parsed = parser.parse(text)
    return parsed.content or "", calls_given(prompt.tools, parsed.tool_calls)
