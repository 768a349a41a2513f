"""GLM-4.5 / 4.6 / 4.7: ``<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``
(GLM-4.7 writes no newlines between the tags)."""

from __future__ import annotations

import re

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.xmlcalls import arguments_json, convert

START, END = "<tool_call>", "</tool_call>"
PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
NAME_END = re.compile(r"[<\n]")


class Glm45Parser(ToolParser):
    name = "glm45"
    starts = (START,)
    end = END

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        body = block[len(START) :].lstrip()
        name_end = NAME_END.search(body)
        if name_end is None and not final:
            return []
        name = body[: name_end.start() if name_end else len(body)].strip()
        if not name or name.startswith("{"):
            raise NotToolCalls("a tool call without a function name")
        schemas = self.parameters(name)
        pairs = [(key.strip(), convert(value, schemas.get(key.strip()))) for key, value in PAIR.findall(body)]
        if final and body.count("<arg_key>") > len(pairs):
            raise NotToolCalls("a parameter cut off")
        return [PartialCall(name, arguments_json(pairs, final))]
