"""Calls written as JSON objects, ``{"name": ..., "arguments": {...}}``: the arguments
are streamed as the model writes them (their raw JSON text)."""

from __future__ import annotations

from xinfer.toolcalls.base import NotToolCalls, PartialCall
from xinfer.toolcalls.json_scan import members, skip_space, string_value, value_end

ARGUMENT_KEYS = ("arguments", "parameters")


def object_call(text: str, start: int, final: bool, strict: bool = True) -> tuple[PartialCall, int | None]:
    """The call written as the object at ``start``, and the object's end (None while open).
    Arguments written as a JSON string (of JSON) are decoded once complete. ``strict``:
    raises NotToolCalls for an object with other members than a call's."""
    found, end = members(text, start)
    name, arguments = None, ""
    for member in found:
        if member.key == "name":
            name = string_value(text, member)
        elif member.key in ARGUMENT_KEYS:
            if member.start < len(text) and text[member.start] == '"':
                arguments = string_value(text, member) or ""
                continue
            stop = member.end if member.end is not None else len(text)
            arguments = text[member.start : stop]
            if member.end is None and final:
                arguments = arguments.rstrip()
        elif strict and member.key not in ("type", "id"):
            raise NotToolCalls(f"a tool call has no member {member.key!r}")
    if end is not None and not arguments:
        arguments = "{}"  # a call without arguments
    if final and name is None:
        raise NotToolCalls("a tool call without a name")
    return PartialCall(name, arguments), end


def object_sequence(text: str, at: int, final: bool, separators: str = ",;", strict: bool = True) -> list[PartialCall]:
    """Calls written as objects one after another from ``at``, between ``separators`` and blanks
    (the items of a JSON array, or Llama's ``;``-separated calls)."""
    calls: list[PartialCall] = []
    while True:
        at = skip_space(text, at)
        while at < len(text) and text[at] in separators:
            at = skip_space(text, at + 1)
        if at >= len(text) or text[at] == "]":
            return calls
        if text[at] != "{":
            raise NotToolCalls("a tool call is not a JSON object")
        call, end = object_call(text, at, final, strict)
        calls.append(call)
        if end is None:
            return calls
        at = end


def raw_arguments(text: str, at: int, final: bool) -> str:
    """The raw JSON text of an arguments value that starts at (or after blanks from) ``at``."""
    start = skip_space(text, at)
    end = value_end(text, start)
    if end is not None:
        return text[start:end]
    written = text[start:]
    return written.rstrip() if final else written
