"""A Responses request as the chat request the engine runs:

- ``instructions`` becomes the first, system message (a previous response's are not carried over, as OpenAI's);
- ``input`` (a string: one user message; or items), after a ``previous_response_id``'s conversation
  (:mod:`xinfer.server.responses_api.store`), becomes the messages: message items with
  ``input_text`` and ``output_text`` parts as text, ``input_image`` parts as ``image_url`` parts
  (refused where the model takes text only); ``function_call`` items as the assistant's
  ``tool_calls`` (with the assistant message or reasoning just before them), ``function_call_output``
  items as ``tool`` messages, ``reasoning`` items as the next assistant turn's ``reasoning_content``;
- function ``tools`` (flat: ``name``, ``parameters``... beside ``type``) become chat's nested
  ``{"type": "function", "function": {...}}``, a ``tool_choice`` naming one ``{"type": "function",
  "name": ...}`` chat's ``{"type": "function", "function": {"name": ...}}``: the chat path parses
  the calls; built-in tools (``web_search``, ``file_search``...), which this server does not run,
  are refused;
- ``max_output_tokens``, ``temperature``, ``top_p`` are the chat request's sampling fields,
  ``text.format`` its ``response_format``, ``reasoning.effort`` its ``reasoning_effort``,
  ``include: ["message.output_text.logprobs"]`` its ``logprobs`` (``top_logprobs`` alternatives).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from xinfer.server.errors import bad_request, from_validation
from xinfer.server.prompts import FIELD, image_fields
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.responses_api.protocol import InputItem, InputPart, ResponsesRequest, TextFormat
from xinfer.server.tools import check_functions, check_tool_choice

TEXT_PARTS = frozenset({"input_text", "output_text"})


def chat_request(body: ResponsesRequest, previous: list[InputItem], takes_images: bool) -> ChatCompletionRequest:
    """``previous``: the conversation of the response it continues (``previous_response_id``), before its input."""
    field = body.unsupported_field()
    if field is not None:
        raise bad_request(f"{field} is not supported by this server's /v1/responses", param=field)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += input_messages(previous, body.input_items(), takes_images)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens}
    fields |= {"temperature": body.temperature, "top_p": body.top_p}
    if body.tools:
        fields["tools"] = chat_tools(body.tools)
    if body.tool_choice is not None:
        fields["tool_choice"] = chat_tool_choice(body.tool_choice)
        try:
            check_tool_choice(fields["tool_choice"], fields.get("tools"))
        except ValueError as error:
            raise bad_request(str(error), param="tool_choice") from None
    fields["parallel_tool_calls"] = body.parallel_tool_calls
    if body.output_logprobs:
        fields |= {"logprobs": True, "top_logprobs": body.top_logprobs}
    if body.text is not None and body.text.format is not None:
        fields["response_format"] = response_format(body.text.format)
    if body.reasoning is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    try:
        # through JSON, so that the chat body is checked exactly as one sent over HTTP
        request = ChatCompletionRequest.model_validate_json(json.dumps(fields))
    except ValidationError as error:
        raise from_validation(error) from None
    request._token_limit_name, request._prompt_name, request._format_name = "max_output_tokens", "input", "text.format"
    request._image_fields = image_fields(messages)
    return request


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for i, tool in enumerate(tools):
        if "type" not in tool:  # OpenAI requires it
            raise bad_request(f"tools[{i}] needs its type ('function')", param=f"tools.{i}.type")
        if tool["type"] != "function":
            raise bad_request(
                f"tools[{i}] is of type {tool['type']!r}, which this server does not run: tools are functions",
                param="tools",
            )
    # a null field is one left out, as the request's own are (the client's FunctionToolParam allows null)
    functions = [{k: v for k, v in tool.items() if k != "type" and v is not None} for tool in tools]
    try:
        check_functions([(f"tools[{i}]", function) for i, function in enumerate(functions)])
    except ValueError as error:
        raise bad_request(str(error), param="tools") from None
    return [{"type": "function", "function": function} for function in functions]


def chat_tool_choice(tool_choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(tool_choice, str):
        return tool_choice
    name = tool_choice.get("name")
    if tool_choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice is "auto", "none", "required" or {"type": "function", "name": ...}, '
            f"got one of type {tool_choice.get('type')!r}",
            param="tool_choice" if "type" in tool_choice else "tool_choice.type",  # OpenAI requires the type
        )
    return {"type": "function", "function": {"name": name}}


def input_messages(previous: list[InputItem], own: list[InputItem], takes_images: bool) -> list[dict[str, Any]]:
    """The chat messages of ``previous`` (a continued response's items) then ``own`` (the request's ``input``); an
    error names its item (``input.N``, or ``previous_response_id``)."""
    if not own:
        raise bad_request("input must not be empty", param="input")
    messages: list[dict[str, Any]] = []
    unanswered: dict[str, str] = {}  # call_id: the item (its param) of a function_call no output answers yet
    for i, item in enumerate([*previous, *own]):
        param = f"input.{i - len(previous)}" if i >= len(previous) else "previous_response_id"
        if item.type == "message":
            turn = message(item, param, takes_images)
            if turn["role"] == "assistant" and reasoning_only(messages):
                messages[-1]["content"] = turn["content"]
            else:
                messages.append(turn)
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise bad_request("a function_call item needs a call_id, a name and arguments", param=param)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            assistant_turn(messages).setdefault("tool_calls", []).append(call)
            unanswered[item.call_id] = param
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise bad_request("a function_call_output item needs a call_id and an output", param=param)
            if not any(call["id"] == item.call_id for turn in messages for call in turn.get("tool_calls", [])):
                raise bad_request(f"no function_call before it has the call_id {item.call_id!r}", param=param)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output_text(item.output, param)})
            unanswered.pop(item.call_id, None)
        elif item.type == "reasoning":
            parts = item.content or []
            text = parts if isinstance(parts, str) else "".join(part.text or "" for part in parts)
            messages.append({"role": "assistant", "content": None, "reasoning_content": text})
        else:
            raise bad_request(
                f"input items of type {item.type!r} are not supported: items are messages, reasoning, "
                "function_call and function_call_output",
                param=param,
            )
    if unanswered:
        call_id, param = next(iter(unanswered.items()))
        raise bad_request(f"no function_call_output answers the function_call {call_id!r}", param=param)
    for turn in messages:
        if turn["role"] == "assistant" and turn["content"] is None and "tool_calls" not in turn:
            turn["content"] = ""  # reasoning given back without the message or call that followed it
    return messages


def reasoning_only(messages: list[dict[str, Any]]) -> bool:
    """Whether the last turn is the assistant's reasoning, given back without what followed it (yet)."""
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and last["content"] is None and "tool_calls" not in last


def assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn that a function call belongs to: the one just before it (its text, its
    reasoning, its other calls), else a new one."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None})
    return messages[-1]


def output_text(output: str | list[InputPart], param: str) -> str:
    if isinstance(output, str):
        return output
    if any(part.type != "input_text" or part.text is None for part in output):
        raise bad_request("a function_call_output's output is text: a string or input_text parts", param=param)
    return "".join(part.text or "" for part in output)


def message(item: InputItem, param: str, takes_images: bool) -> dict[str, Any]:
    if item.role is None or item.content is None:
        raise bad_request("a message item needs a role and content", param=param)
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    parts = [content_part(part, f"{param}.content.{j}", takes_images) for j, part in enumerate(item.content)]
    return {"role": item.role, "content": parts}


def content_part(part: InputPart, param: str, takes_images: bool) -> dict[str, Any]:
    if part.type in TEXT_PARTS and part.text is not None:
        return {"type": "text", "text": part.text}
    if part.type == "refusal" and part.refusal is not None:  # an assistant's refusal given back: what it said
        return {"type": "text", "text": part.refusal}
    if part.type == "input_image" and part.image_url is not None:
        if not takes_images:
            raise bad_request("this model takes text only: it cannot read images", param=param)
        image_url = {"url": part.image_url} | ({"detail": part.detail} if part.detail else {})
        return {"type": "image_url", "image_url": image_url, FIELD: f"{param}.image_url"}
    raise bad_request(
        f"content part of type {part.type!r} is not supported: parts are input_text, output_text, refusal or "
        "input_image with an image_url",
        param=param,
    )


def response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = {"name": text_format.name, "schema": text_format.json_schema, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": schema}
