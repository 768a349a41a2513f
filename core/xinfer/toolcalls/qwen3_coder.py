"""Qwen3-Coder: ``<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>``."""

from __future__ import annotations

import re

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.xmlcalls import tagged_calls

START, END = "<tool_call>", "</tool_call>"
FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>")


class Qwen3CoderParser(ToolParser):
    name = "qwen3_coder"
    starts = (START,)
    end = END

    def find_end(self, text: str, start: int) -> int:
        # a parameter's value may hold the end tag as text: the block ends after its function
        function_end = text.find("</function>", start)
        return text.find(END, function_end) if function_end >= 0 else -1

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        body = block[len(START) :]
        calls = tagged_calls(self, body, final, FUNCTION, "</function>", PARAMETER, "</parameter>")
        if final and not calls:
            raise NotToolCalls("no <function=...> in a tool call")
        if not calls and body.strip() and not "<function=".startswith(body.strip()[:10]):
            raise NotToolCalls("a tool call without <function=...>")
        return calls
