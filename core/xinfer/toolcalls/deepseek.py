"""DeepSeek V3 / R1 and V3.1 / V3.2 chat formats. V3 and R1:
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
<｜tool▁calls▁end｜>``; V3.1: ``<｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`` in the same block."""

from __future__ import annotations

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.json_scan import skip_space, value_end
from xinfer.toolcalls.jsoncalls import raw_arguments

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"  # noqa: RUF001 (DeepSeek's markers use fullwidth bars)
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"  # noqa: RUF001 (DeepSeek's markers use fullwidth bars)
FENCE = "```json"


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    starts = (CALLS_BEGIN,)
    end = CALLS_END
    keeps_special_tokens = True

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        calls = []
        pieces = block.split(CALL_BEGIN)[1:]
        for number, piece in enumerate(pieces):
            done = CALL_END in piece or final or number + 1 < len(pieces)
            piece = piece.split(CALL_END)[0]
            if SEP not in piece:
                if done:
                    raise NotToolCalls(f"a call without {SEP}")
                break
            kind, rest = piece.split(SEP, 1)
            if kind.strip() == "function" and not rest.lstrip().startswith("{"):
                call = self._fenced(rest, done)  # V3 / R1
            else:
                call = PartialCall(kind.strip(), raw_arguments(rest, 0, done))  # V3.1
            if call.name is None:
                break
            calls.append(call)
        return calls

    @staticmethod
    def _fenced(rest: str, done: bool) -> PartialCall:
        """``f\\n```json\\n{...}\\n````: the name up to its newline, the arguments inside the fence."""
        newline = rest.find("\n")
        if newline < 0:
            return PartialCall(rest.strip() if done else None)
        name, body = rest[:newline].strip(), rest[newline + 1 :]
        fence = body.find(FENCE)
        if fence < 0:
            return PartialCall(name)  # arguments not written (yet)
        start = skip_space(body, fence + len(FENCE))
        end = value_end(body, start)
        if end is not None:
            return PartialCall(name, body[start:end])
        written = body[start:]
        if done:
            written = written.rstrip().removesuffix("```").rstrip()
        return PartialCall(name, written)
