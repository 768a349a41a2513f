"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``,
one block per call (Qwen's chat templates write this format, and its system prompt asks for it)."""

from __future__ import annotations

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.json_scan import find_outside_strings, skip_space
from xinfer.toolcalls.jsoncalls import object_call

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    starts = (START,)
    end = END

    def find_end(self, text: str, start: int) -> int:
        return find_outside_strings(text, END, start)  # arguments may hold the end tag as text

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        at = skip_space(block, len(START))
        if at >= len(block):
            if final:
                raise NotToolCalls("an empty tool call")
            return []
        if block[at] != "{":
            raise NotToolCalls("a tool call is not a JSON object")
        call, end = object_call(block, at, final, strict=False)
        if end is not None and block[end:].strip():
            raise NotToolCalls("text after a tool call's object")
        return [call]
