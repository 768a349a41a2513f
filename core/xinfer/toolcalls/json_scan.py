"""Scanning JSON text that may still be growing: where a value ends, the members of an
object, without parsing more than is written. Tool-call parsers stream a call's
arguments as the model writes them, so they need positions in the text, not values."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
# regexes, not loops over characters: a stream scans its open block again at every delta
_STRUCTURE = re.compile(r'["{}\[\]]')


def skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


def value_end(text: str, start: int) -> int | None:
    """The end (exclusive) of the JSON value that begins at ``start``, or None while it is
    not complete. Nesting and strings are followed; a scalar ends at a delimiter."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        depth, at = 0, start
        while (found := _STRUCTURE.search(text, at)) is not None:
            at = found.start()
            char = text[at]
            if char == '"':
                end = _string_end(text, at)
                if end is None:
                    return None
                at = end
                continue
            if char in "{[":
                depth += 1
            elif char in "}]":
                depth -= 1
                if depth == 0:
                    return at + 1
            at += 1
        return None
    at = start
    while at < len(text) and text[at] not in ",}]" + WHITESPACE:
        at += 1
    return at if at < len(text) else None


def find_outside_strings(text: str, marker: str, start: int) -> int:
    """The first ``marker`` in ``text`` from ``start`` that is not inside a JSON string (-1: none)."""
    pattern = re.compile(re.escape(marker) + '|"')
    at = start
    while (found := pattern.search(text, at)) is not None:
        if found.group() != '"':
            return found.start()
        end = _string_end(text, found.start())
        if end is None:
            return -1
        at = end
    return -1


def _string_end(text: str, start: int) -> int | None:
    """The end of the JSON string that opens at ``start`` (None while it is open)."""
    at = start
    while (at := text.find('"', at + 1)) >= 0:
        before = at
        while text[before - 1] == "\\":
            before -= 1
        if (at - before) % 2 == 0:  # not escaped
            return at + 1
    return None


@dataclass(frozen=True)
class Member:
    """One member of an object: its key, where its value starts, and where it ends (None:
    not complete yet)."""

    key: str
    start: int
    end: int | None


def members(text: str, start: int) -> tuple[list[Member], int | None]:
    """The members of the object that begins at ``start`` (``{``) as far as they are
    written, and the end of the object (None while it is open). The last member may be
    incomplete (its ``end`` None); a member whose key is not complete is not listed."""
    found: list[Member] = []
    at = skip_space(text, start + 1)
    while at < len(text):
        if text[at] == "}":
            return found, at + 1
        if text[at] == ",":
            at = skip_space(text, at + 1)
            continue
        key_end = _string_end(text, at) if text[at] == '"' else None
        if key_end is None:
            break
        colon = skip_space(text, key_end)
        if colon >= len(text) or text[colon] != ":":
            break
        value_start = skip_space(text, colon + 1)
        end = value_end(text, value_start)
        found.append(Member(json.loads(text[at:key_end]), value_start, end))
        if end is None:
            break
        at = skip_space(text, end)
    return found, None


def string_value(text: str, member: Member) -> str | None:
    """A member's string value once it is complete (None before, or for another type)."""
    if member.end is None or text[member.start] != '"':
        return None
    value = json.loads(text[member.start : member.end])
    return value if isinstance(value, str) else None
