"""The tool calls in an answer's text, read by the request's tool parser."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from xinfer.server.chat_run import ChatPrompt


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    input: dict[str, Any]


def read_calls(prompt: ChatPrompt, text: str) -> tuple[str, list[Call]]:
    """(the answer's text without its calls, the calls); all text where the request's parser finds none."""
    parser = prompt.tool_parser
    if parser is None:
        return text, []
    parsed = parser.parse(text)
    calls = [Call(c.id, c.name, arguments(c.arguments)) for c in parsed.tool_calls]
    return (parsed.content or "" if calls else text), calls


def arguments(text: str | None) -> dict[str, Any]:
    """A call's arguments as an object (a model's malformed arguments: kept whole, under ``_raw``)."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_raw": value}
