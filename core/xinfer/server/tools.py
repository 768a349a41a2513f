"""Tool calling on chat completions: a request's ``tools`` and ``tool_choice`` checked, the
parser that reads its answer, and the grammar that a forced call (``required`` or a named
function) is held to."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pydantic_core

from xinfer.server.errors import FieldError
from xinfer.toolcalls import (
    NamedFunctionParser,
    RequiredCallsParser,
    ToolCall,
    ToolParser,
    named_schema,
    required_schema,
)

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
CHOICES = ("none", "auto", "required")


def check_tools(tools: list[dict[str, Any]]) -> None:
    """OpenAI's function tools (chat's shape: ``{"type": "function", "function": {...}}``, the type required as
    OpenAI requires it); FieldError naming the first problem."""
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            raise FieldError(f"tools.{i}.type", f"{where}.type must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise FieldError("tools", f"{where}.function must be an object with a name")
        functions.append((f"{where}.function", function))
    try:
        check_functions(functions)
    except ValueError as error:
        raise FieldError("tools", str(error)) from None


def check_functions(functions: list[tuple[str, dict[str, Any]]]) -> None:
    """Functions (each where it is given), each with a name of its own and a valid JSON schema of its
    parameters; ValueError naming the first problem."""
    from xinfer.grammar import StructuredOutputs

    names = set()
    for where, function in functions:
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise ValueError(f"{where}.name must be 1 to 64 letters, digits, _ . : or -, got {name!r}")
        if name in names:
            raise ValueError(f"{where}.name {name!r} is given twice")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{where}.description must be a string")
        parameters = function.get("parameters")
        if parameters is None:
            continue
        if not isinstance(parameters, dict):
            raise ValueError(f"{where}.parameters must be a JSON schema object")
        try:
            StructuredOutputs(json=parameters, strict=False)
        except ValueError as error:
            raise ValueError(f"{where}.parameters: {error}") from None


def forced_function(tool_choice: str | dict[str, Any] | None) -> str | None:
    """The function a ``tool_choice`` object names (``{"type": "function", "function": {"name": ...}}``)."""
    if not isinstance(tool_choice, dict):
        return None
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


def check_tool_choice(tool_choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> None:
    """Chat's ``tool_choice`` (an object's type required, as OpenAI requires it); FieldError naming the problem."""
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise FieldError(
                "tool_choice", f"tool_choice must be one of {', '.join(CHOICES)} or a function, got {tool_choice!r}"
            )
        if tool_choice == "required" and not tools:
            raise FieldError("tool_choice", "tool_choice 'required' needs tools")
        return
    shape = 'tool_choice as an object must be {"type": "function", "function": {"name": ...}}'
    if tool_choice.get("type") != "function":
        raise FieldError("tool_choice.type", f"{shape}, got type {tool_choice.get('type')!r}")
    name = forced_function(tool_choice)
    if name is None:
        raise FieldError("tool_choice.function", shape)
    if not any((tool.get("function") or {}).get("name") == name for tool in tools or []):
        raise FieldError("tool_choice", f"tool_choice names the function {name!r}, which is not in tools")


def forced_schema(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel: bool | None
) -> dict[str, Any] | None:
    """The JSON schema the answer is held to where ``tool_choice`` forces a call (None: it does not)."""
    if not tools:
        return None
    name = forced_function(tool_choice)
    if name is not None:
        return named_schema(tools, name)
    if tool_choice == "required":
        return required_schema(tools, parallel is not False)
    return None


@dataclass(frozen=True)
class ToolUse:
    """How a request uses tools: the tools its chat template gets, and the parser of its answer
    (None: the answer is text only)."""

    template_tools: list[dict[str, Any]] | None = None
    parser: ToolParser | None = None
    parallel: bool = True

    def given(self, found: list[ToolCall]) -> list[ToolCall]:
        """The calls an answer gives of those its parser found: only the first where parallel calls are off."""
        return found if self.parallel else found[:1]

    @property
    def finishes_with_calls(self) -> bool:
        """Whether an answer that called tools finishes with ``tool_calls``: not where the request named
        the function, which OpenAI (and vLLM's serving_chat) finish with ``stop``."""
        return not isinstance(self.parser, NamedFunctionParser)


def tool_use(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel: bool | None,
    family: type[ToolParser] | None,
) -> ToolUse:
    """``family``: the served model's parser (``--enforce-parser`` or its chat template's),
    used where the model chooses (``auto``)."""
    if not tools or tool_choice == "none":
        return ToolUse()  # the template is not told of tools the model may not call
    name = forced_function(tool_choice)
    parser: ToolParser | None
    if name is not None:
        parser = NamedFunctionParser(name, tools)
    elif tool_choice == "required":
        parser = RequiredCallsParser(tools)
    else:
        parser = family(tools) if family is not None else None
    return ToolUse(tools, parser, parallel is not False)


@dataclass(frozen=True)
class Call:
    """A tool call the model made, its arguments an object."""

    id: str
    name: str
    input: dict[str, Any]

    @classmethod
    def of(cls, id: str, name: str, arguments: str | None) -> Call:
        """A call whose arguments are JSON text. A forced call cut by the token limit holds what its cut text
        holds (its partial-JSON parse, as Anthropic's client reads a cut ``tool_use`` stream); malformed
        arguments, which only a stream lets out, are kept whole under ``_raw``."""
        try:
            value = pydantic_core.from_json(arguments or "{}", allow_partial=True)
        except ValueError:
            return cls(id, name, {"_raw": arguments})
        return cls(id, name, value if isinstance(value, dict) else {"_raw": value})


def calls_given(tools: ToolUse, found: list[ToolCall]) -> list[Call]:
    """The calls an answer gives of those its parser found (:meth:`ToolUse.given`), their inputs objects."""
    return [Call.of(c.id, c.name, c.arguments) for c in tools.given(found)]
