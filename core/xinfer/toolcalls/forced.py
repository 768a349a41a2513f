"""Calls that a request forces (``tool_choice`` ``required`` or a named function): the
output is held to a grammar in a model-independent JSON shape, read back by these parsers.

- a named function: the output is its arguments object;
- ``required``: the output is ``[{"name": "f", "parameters": {...}}, ...]`` (one item
  where parallel calls are off).
"""

from __future__ import annotations

from typing import Any

from xinfer.toolcalls.base import NotToolCalls, PartialCall, ToolParser
from xinfer.toolcalls.jsoncalls import object_sequence, raw_arguments

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function")
    return function if isinstance(function, dict) else {}


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    schema = function_of(tool).get("parameters")
    return schema if isinstance(schema, dict) and schema else ANY_OBJECT


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The grammar's JSON schema where ``name`` must be called: its parameters."""
    for tool in tools:
        if function_of(tool).get("name") == name:
            return parameters_schema(tool)
    raise ValueError(f"tool_choice names the function {name!r}, which is not in tools")


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """The grammar's JSON schema where some tool must be called: a list of calls."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": function_of(tool).get("name")}, "parameters": parameters_schema(tool)},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedFunctionParser(ToolParser):
    """The whole output is the arguments of ``function``, whatever it holds (vLLM's named tool_choice:
    one cut by the token limit is the call's arguments still)."""

    name = "named_function"
    starts = ("",)
    at_start_only = True
    checks_calls = False

    def __init__(self, function: str, tools: list[dict[str, Any]] | None = None):
        super().__init__(tools)
        self.function = function

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        return [PartialCall(self.function, raw_arguments(block, 0, final))]


class RequiredCallsParser(ToolParser):
    """The whole output is a JSON list of ``{"name", "parameters"}`` objects."""

    name = "required"
    starts = ("[",)
    at_start_only = True

    def calls(self, block: str, final: bool) -> list[PartialCall]:
        calls = object_sequence(block, 1, final, separators=",")
        if final and not calls:
            raise NotToolCalls("an empty list of calls")
        return calls
