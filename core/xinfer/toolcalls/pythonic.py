"""Pythonic calls, ``[f(a=1), g(b="x")]`` as the whole output (Llama 3.2 / 4 with the
pythonic template, Llama 4 between ``<|python_start|>`` and ``<|python_end|>``): keyword
arguments that are Python literals. A call's arguments go out once its parenthesis closes."""

from __future__ import annotations

import ast
import json
import re

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.json_scan import skip_space

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
NAME = re.compile(r"[A-Za-z_][\w.]*")
OPENERS, CLOSERS = "([{", ")]}"


class PythonicParser(ToolParser):
    name = "pythonic"
    starts = (PYTHON_START, "[")
    end = PYTHON_END
    at_start_only = True
    tentative_starts = ("[",)  # a list may be the answer itself
    keeps_special_tokens = True  # <|python_start|> is a special token

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        at = skip_space(block, len(PYTHON_START) if block.startswith(PYTHON_START) else 0)
        if at >= len(block):
            if final:
                raise NotToolCalls("no calls")
            return []
        if block[at] != "[":
            raise NotToolCalls("pythonic calls are a list")
        calls, end = _listed_calls(block, at + 1)
        if end is not None and block[end:].strip():
            raise NotToolCalls("text after the list of calls")
        if final and (end is None or not calls):
            raise NotToolCalls("no calls, or a list of calls cut off")
        return calls


def _listed_calls(block: str, at: int) -> tuple[list[PartialCall], int | None]:
    """The complete calls of the list whose items start at ``at``, and the end of the list (None while open)."""
    calls: list[PartialCall] = []
    while True:
        at = skip_space(block, at)
        if at < len(block) and block[at] == ",":
            at += 1
            continue
        if at >= len(block):
            return calls, None
        if block[at] == "]":
            return calls, at + 1
        name = NAME.match(block, at)
        if name is None:
            raise NotToolCalls("a list item that is not a call")
        if name.end() >= len(block):
            return calls, None  # the name may go on
        if block[name.end()] != "(":
            raise NotToolCalls("a list item that is not a call")
        close = _closing(block, name.end())
        if close is None:
            return calls, None  # its name goes out with its arguments, once they proved literals
        calls.append(PartialCall(name.group(), _arguments(block[at:close])))
        at = close


def _closing(text: str, start: int) -> int | None:
    """The end (exclusive) of the bracketed expression that opens at ``start``, Python strings skipped."""
    depth, at, quote = 0, start, ""
    while at < len(text):
        char = text[at]
        if quote:
            if char == "\\":
                at += 1
            elif char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in OPENERS:
            depth += 1
        elif char in CLOSERS:
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    return None


def _arguments(call: str) -> str:
    try:
        tree = ast.parse(call, mode="eval").body
        if not isinstance(tree, ast.Call) or tree.args:
            raise NotToolCalls("pythonic calls take keyword arguments only")
        values = {keyword.arg: ast.literal_eval(keyword.value) for keyword in tree.keywords if keyword.arg}
        return json.dumps(values, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as error:
        raise NotToolCalls(f"not a call of literals: {error}") from None
