"""OpenAI-style chat messages as chat templates read them, for the server's chat routes and the offline
``LLM.chat`` alike."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from xinfer.text.chat_template import ChatTemplate, ChatTemplateError

# the content parts read as text, by type, and the field holding their text (vLLM's MM_PARSER_MAP)
TEXT_PART_FIELDS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def template_content(parts: list[dict[str, Any]], content_format: str) -> str | list[dict[str, Any]]:
    """A message's content parts (text parts as ``{"type": "text", "text": ...}``) as a template whose
    ``content_format`` is "string" reads text alone: one string, the parts joined by newlines; else the parts."""
    if content_format == "string" and all(part.get("type") == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def render_messages(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
    """Renders ``messages`` (their content as the template reads it) with :func:`message_for_template`'s changes;
    a template that fails on tool calls' arguments as objects gets them as the JSON text the client sent
    (DeepSeek's joins them as text: '...' + arguments). ``options``: those of :meth:`ChatTemplate.render`."""
    try:
        return template.render([message_for_template(m) for m in messages], **options)
    except ChatTemplateError:
        if not any(m.get("tool_calls") for m in messages):
            raise
        return template.render([message_for_template(m, arguments_as_objects=False) for m in messages], **options)


def message_for_template(message: Mapping[str, Any], arguments_as_objects: bool = True) -> dict[str, Any]:
    """``message`` with null content as "" (clients send null beside tool calls; templates read it as text, Qwen3:
    '</think>' in content) and, with ``arguments_as_objects``, its tool calls' arguments decoded from their JSON
    text: templates write them with ``tojson`` (Llama, Mistral) or as they are (Qwen, which takes either)."""
    item = dict(message)
    if item.get("content") is None:
        item["content"] = ""
    calls = item.get("tool_calls")
    if arguments_as_objects and isinstance(calls, list):
        item["tool_calls"] = [_call_for_template(call) for call in calls]
    return item


def _call_for_template(call: Any) -> Any:
    """A tool call with its arguments as an object; arguments that are not the JSON text of one (an object
    already, or other text) stay as they are."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}
