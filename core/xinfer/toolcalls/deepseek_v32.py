"""DeepSeek-V3.2's DSML calls: ``<｜DSML｜function_calls>\\n<｜DSML｜invoke name="f">\\n
<｜DSML｜parameter name="p" string="true">text</｜DSML｜parameter>\\n</｜DSML｜invoke>\\n</｜DSML｜function_calls>``,
several invokes in one block; ``string="false"`` marks a value written as JSON."""

from __future__ import annotations

import re

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.xmlcalls import tagged_calls

DSML = "｜DSML｜"  # noqa: RUF001 (DeepSeek's markers use fullwidth bars)
START, END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE = re.compile(f'<{DSML}invoke name="([^"\\n]+)">')
PARAMETER = re.compile(f'<{DSML}parameter name="([^"\\n]+)"(?: string="(?P<string>true|false)")?>')


class DeepSeekV32Parser(ToolParser):
    name = "deepseek_v32"
    starts = (START,)
    end = END
    keeps_special_tokens = True  # as DeepSeek's other markers, in case the tokenizer has them as special tokens

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        body = block[len(START) :]
        calls = tagged_calls(self, body, final, INVOKE, f"</{DSML}invoke>", PARAMETER, f"</{DSML}parameter>")
        if final and not calls:
            raise NotToolCalls(f"no <{DSML}invoke name=...> in a tool call")
        return calls
