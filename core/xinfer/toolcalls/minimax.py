"""MiniMax-M2: ``<minimax:tool_call>\\n<invoke name="f">\\n<parameter name="p">value</parameter>\\n</invoke>\\n
</minimax:tool_call>``, several invokes in one block."""

from __future__ import annotations

import re

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.xmlcalls import tagged_calls

START, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE = re.compile(r'<invoke name="([^"\n]+)">')
PARAMETER = re.compile(r'<parameter name="([^"\n]+)">')


class MiniMaxM2Parser(ToolParser):
    name = "minimax_m2"
    starts = (START,)
    end = END

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        calls = tagged_calls(self, block[len(START) :], final, INVOKE, "</invoke>", PARAMETER, "</parameter>")
        if final and not calls:
            raise NotToolCalls("no <invoke name=...> in a tool call")
        return calls
