"""Mistral: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (v0.3 templates), or
``[TOOL_CALLS]f[ARGS]{...}`` once per call (v11 and later tokenizers: Mistral Small 3.2,
Magistral, Devstral), with ``[CALL_ID]id`` before ``[ARGS]`` in some."""

from __future__ import annotations

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser, short_id
from xinfer.toolcalls.json_scan import skip_space
from xinfer.toolcalls.jsoncalls import object_sequence, raw_arguments

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class MistralParser(ToolParser):
    name = "mistral"
    starts = (TOOL_CALLS,)
    keeps_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def new_id(self) -> str:
        return short_id(9)  # Mistral's templates accept only nine letters and digits

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        at = skip_space(block, len(TOOL_CALLS))
        if block.startswith("[", at) and not block.startswith(TOOL_CALLS, at):
            return object_sequence(block, at + 1, final, separators=",", strict=False)
        calls = []
        pieces = block.split(TOOL_CALLS)[1:]
        for number, piece in enumerate(pieces):
            last = number + 1 == len(pieces)
            index = piece.find(ARGS)
            if index < 0:
                if final and last:
                    raise NotToolCalls(f"a call without {ARGS}")
                break
            name = piece[:index].split(CALL_ID)[0].strip()
            if not name:
                raise NotToolCalls("a call without a name")
            calls.append(PartialCall(name, raw_arguments(piece, index + len(ARGS), final or not last)))
        return calls
