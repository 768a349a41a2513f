"""Llama 3.1 / 3.2 / 3.3 JSON calls: the output is ``{"name": "f", "parameters": {...}}`` (several
joined by ``;``), after ``<|python_tag|>`` or alone, as the templates' system prompt asks."""

from __future__ import annotations

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.json_scan import skip_space
from xinfer.toolcalls.jsoncalls import object_sequence

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    starts = (PYTHON_TAG, "{")
    at_start_only = True
    tentative_starts = ("{",)  # a JSON object may be the answer itself
    keeps_special_tokens = True  # <|python_tag|> is a special token

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        at = skip_space(block, len(PYTHON_TAG) if block.startswith(PYTHON_TAG) else 0)
        if at < len(block) and block[at] != "{":
            raise NotToolCalls("not a JSON call (Llama's built-in tools are written as code)")
        calls = object_sequence(block, at, final, separators=";")
        if final and not calls:
            raise NotToolCalls("no call")
        return calls
