"""A Responses request as the chat request the engine runs:

- ``instructions`` becomes the first, system message;
- ``input`` (a string: one user message; or message items) becomes the messages, ``input_text``
  and ``output_text`` parts their text, ``input_image`` parts ``image_url`` parts (refused where
  the model takes text only);
- ``max_output_tokens``, ``temperature``, ``top_p`` are the chat request's sampling fields,
  ``text.format`` its ``response_format``, ``reasoning.effort`` its ``reasoning_effort``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from xinfer.server.errors import bad_request, from_validation
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.responses_api.protocol import InputItem, InputPart, ResponsesRequest, TextFormat

TEXT_PARTS = frozenset({"input_text", "output_text"})


def chat_request(body: ResponsesRequest, takes_images: bool) -> ChatCompletionRequest:
    field = body.unsupported_field()
    if field is not None:
        raise bad_request(f"{field} is not supported by this server's /v1/responses", param=field)
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += input_messages(body.input, takes_images)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens}
    fields |= {"temperature": body.temperature, "top_p": body.top_p}
    if body.text is not None and body.text.format is not None:
        fields["response_format"] = response_format(body.text.format)
    if body.reasoning is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    try:
        # through JSON, so that the chat body is checked exactly as one sent over HTTP
        request = ChatCompletionRequest.model_validate_json(json.dumps(fields))
    except ValidationError as error:
        raise from_validation(error) from None
    request._token_limit_name = "max_output_tokens"
    return request


def input_messages(given: str | list[InputItem], takes_images: bool) -> list[dict[str, Any]]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise bad_request("input must not be empty", param="input")
    return [message(item, f"input.{i}", takes_images) for i, item in enumerate(given)]


def message(item: InputItem, param: str, takes_images: bool) -> dict[str, Any]:
    if item.type != "message":
        raise bad_request(f"input items of type {item.type!r} are not supported: items are messages", param=param)
    if item.role is None or item.content is None:
        raise bad_request("a message item needs a role and content", param=param)
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    parts = [content_part(part, f"{param}.content.{j}", takes_images) for j, part in enumerate(item.content)]
    return {"role": item.role, "content": parts}


def content_part(part: InputPart, param: str, takes_images: bool) -> dict[str, Any]:
    if part.type in TEXT_PARTS and part.text is not None:
        return {"type": "text", "text": part.text}
    if part.type == "input_image" and part.image_url is not None:
        if not takes_images:
            raise bad_request("this model takes text only: it cannot read images", param=param)
        image_url = {"url": part.image_url} | ({"detail": part.detail} if part.detail else {})
        return {"type": "image_url", "image_url": image_url}
    raise bad_request(
        f"content part of type {part.type!r} is not supported: parts are input_text, output_text or "
        "input_image with an image_url",
        param=param,
    )


def response_format(text_format: TextFormat) -> dict[str, Any]:
    if text_format.type != "json_schema":
        return {"type": text_format.type}
    schema = {"name": text_format.name, "schema": text_format.json_schema, "strict": text_format.strict}
    return {"type": "json_schema", "json_schema": schema}
