"""MiniMax-M1: ``<tool_calls>\\n{"name": "f", "arguments": {...}}\\n{"name": "g", ...}\\n</tool_calls>``,
one JSON object a line (vLLM's ``minimax`` parser)."""

from __future__ import annotations

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.jsoncalls import object_sequence

START, END = "<tool_calls>", "</tool_calls>"


class MiniMaxM1Parser(ToolParser):
    name = "minimax"
    starts = (START,)
    end = END

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        calls = object_sequence(block, len(START), final, separators="", strict=False)
        if final and not calls:
            raise NotToolCalls("no call in <tool_calls>")
        return calls
