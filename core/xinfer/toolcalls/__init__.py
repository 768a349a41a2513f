"""Tool calls read out of a model's output, one module per family's format.

The API, independent of any HTTP shape:

- :func:`parser_for` (``--enforce-parser`` names, :data:`PARSERS`) or :func:`detect`
  (from the chat template's source) picks a :class:`ToolParser` class;
- ``parser.parse(text)`` -> :class:`ParsedOutput` (content and :class:`ToolCall` list);
- ``stream = parser.stream()``; ``stream.push(delta)`` / ``stream.finish()`` ->
  :class:`StreamDelta` (content and :class:`ToolCallDelta` pieces: id and name first,
  then argument fragments), whose pieces concatenate to what ``parse`` returns.
"""

from __future__ import annotations

from typing import Any

from xinfer.toolcalls.base import (
    NotToolCalls,
    ParsedOutput,
    PartialCall,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
)
from xinfer.toolcalls.deepseek import DeepSeekV3Parser
from xinfer.toolcalls.deepseek_v32 import DeepSeekV32Parser
from xinfer.toolcalls.forced import NamedFunctionParser, RequiredCallsParser, named_schema, required_schema
from xinfer.toolcalls.glm import Glm45Parser
from xinfer.toolcalls.hermes import HermesParser
from xinfer.toolcalls.llama3 import Llama3JsonParser
from xinfer.toolcalls.minimax import MiniMaxM2Parser
from xinfer.toolcalls.minimax_m1 import MiniMaxM1Parser
from xinfer.toolcalls.mistral import MistralParser
from xinfer.toolcalls.pythonic import PythonicParser
from xinfer.toolcalls.qwen3_coder import Qwen3CoderParser

FAMILIES: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesParser,
        Qwen3CoderParser,
        Llama3JsonParser,
        MistralParser,
        DeepSeekV3Parser,
        DeepSeekV32Parser,
        Glm45Parser,
        MiniMaxM1Parser,
        MiniMaxM2Parser,
        PythonicParser,
    )
}
# other names the same formats go by (vLLM's parser names among them)
ALIASES = {
    "qwen": "hermes",
    "qwen2_5": "hermes",
    "qwen3": "hermes",
    "llama3": "llama3_json",
    "deepseek_r1": "deepseek_v3",
    "deepseek_v31": "deepseek_v3",
    "glm4_moe": "glm45",
    "glm46": "glm45",
    "glm47": "glm45",
    "llama4_pythonic": "pythonic",
}
PARSERS = sorted([*FAMILIES, *ALIASES])

# what a chat template writes when it renders an assistant's tool calls, most specific first
_SIGNATURES = (
    ("<minimax:tool_call>", "minimax_m2"),
    ("<tool_calls>", "minimax"),
    ("｜DSML｜function_calls", "deepseek_v32"),  # noqa: RUF001 (DeepSeek's markers use fullwidth bars)
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<arg_key>", "glm45"),
    ("<function=", "qwen3_coder"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
)


def parser_for(name: str) -> type[ToolParser]:
    """The parser of a name in :data:`PARSERS`; KeyError for another."""
    return FAMILIES[ALIASES.get(name, name)]


def detect(template_source: str | None) -> type[ToolParser] | None:
    """The parser whose format a chat template writes, or None for a template without tool calls."""
    source = template_source or ""
    for signature, name in _SIGNATURES:
        if signature in source:
            return FAMILIES[name]
    return None


def parse(name: str, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedOutput:
    """``text`` parsed by the named family's parser."""
    return parser_for(name)(tools).parse(text)


__all__ = [
    "ALIASES",
    "FAMILIES",
    "PARSERS",
    "NamedFunctionParser",
    "NotToolCalls",
    "ParsedOutput",
    "PartialCall",
    "RequiredCallsParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "detect",
    "named_schema",
    "parse",
    "parser_for",
    "required_schema",
]
