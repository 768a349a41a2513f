"""Calls written as tags with one parameter each (Qwen3-Coder, MiniMax-M2, GLM-4.5):
values are plain text where the schema says string, JSON otherwise. The arguments are
streamed as a JSON object that grows by one member per finished parameter."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from xinfer.toolcalls.base import PartialCall, ToolParser


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the value its JSON schema describes: strings stay text, other
    types are read as JSON (or as a Python literal, as models sometimes write them)."""
    declared = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(declared) if isinstance(declared, list) else {declared} if declared else set()
    if kinds == {"string"}:
        return value
    for read in (json.loads, ast.literal_eval):
        try:
            converted = read(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if not kinds or _json_type(converted) in kinds or ("number" in kinds and isinstance(converted, int)):
            return converted
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, (list, tuple)) else "object"


def arguments_json(pairs: list[tuple[str, Any]], closed: bool) -> str:
    """The arguments object's JSON text (as ``json.dumps`` writes it), open while more may come."""
    items = ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}" for k, v in pairs)
    return "{" + items + ("}" if closed else "")


def tagged_calls(
    parser: ToolParser,
    body: str,
    final: bool,
    call_open: re.Pattern[str],
    call_close: str,
    param_open: re.Pattern[str],
    param_close: str,
) -> list[PartialCall]:
    """Calls opened by ``call_open`` (its group 1 the name) holding parameters opened by
    ``param_open`` (group 1 the parameter's name; a group ``string`` that reads ``true``: the
    value is text whatever the schema says). A parameter's value ends at
    ``param_close``, or at the next parameter or the call's end where the model left the
    close out; one newline on each side of a value is the template's, not the value's."""
    calls = []
    opens = list(call_open.finditer(body))
    for number, match in enumerate(opens):
        stop = opens[number + 1].start() if number + 1 < len(opens) else len(body)
        text = body[match.end() : stop]
        close = text.find(call_close)
        closed = close >= 0 or final or number + 1 < len(opens)
        text = text[:close] if close >= 0 else text
        schemas = parser.parameters(match.group(1))
        pairs = []
        params = list(param_open.finditer(text))
        for index, param in enumerate(params):
            limit = params[index + 1].start() if index + 1 < len(params) else len(text)
            end = text.find(param_close, param.end(), limit)
            if end < 0 and not (closed or index + 1 < len(params)):
                break  # still being written
            value = text[param.end() : end if end >= 0 else limit]
            value = value.removeprefix("\n").removesuffix("\n")
            name = param.group(1).strip()
            schema = {"type": "string"} if param.groupdict().get("string") == "true" else schemas.get(name)
            pairs.append((name, convert(value, schema)))
        calls.append(PartialCall(match.group(1).strip(), arguments_json(pairs, closed)))
    return calls
