"""Turning request bodies into prompt token ids: chat templates and plain prompts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xinfer.server.errors import bad_request
from xinfer.server.protocol import ChatMessage, Prompt, prompt_list
from xinfer.text.chat_messages import TEXT_PART_FIELDS, render_messages, template_content


def message_dicts(
    messages: list[ChatMessage], content_format: str = "string"
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """Messages as chat templates expect them: text parts joined into one string by newlines for a template
    whose ``content_format`` is "string" (:class:`~xinfer.text.chat_template.ChatTemplate`), else kept a list;
    where a message has images, its content stays a list, each image an ``{"type": "image"}`` item (as HF
    templates read them). Also each image's URL, in order, with the request field it came from. Tool calls and
    null content are left to :func:`~xinfer.text.chat_messages.render_messages`."""
    result, images = [], []
    for i, message in enumerate(messages):
        # templates read reasoning_content; a refusal given back is already the content
        item = message.model_dump(exclude_none=True, exclude={"reasoning", "refusal"})
        if isinstance(message.content, list):
            parts: list[dict[str, Any]] = []
            for j, part in enumerate(message.content):
                field = TEXT_PART_FIELDS.get(part.type, "image_url" if part.type == "image_url" else None)
                if field is None:
                    raise bad_request(f"content part of type {part.type!r} is not supported: parts are image_url or "
                                      f"text ({', '.join(TEXT_PART_FIELDS)})", param=f"messages.{i}.content.{j}")  # fmt: skip
                if getattr(part, field) is None:
                    raise bad_request(f"a {part.type} part needs its {field} field", param=f"messages.{i}.content.{j}")
                if field == "image_url" and part.image_url is not None:
                    parts.append({"type": "image"})
                    images.append((part.image_url.url, f"messages.{i}.content.{j}.image_url"))
                else:
                    parts.append({"type": "text", "text": getattr(part, field)})
            item["content"] = template_content(parts, content_format)
        result.append(item)
    return result, images


# the key under which a route that translates its body into a chat body marks each image part with the field of
# its own body the image came from (the chat body's validation ignores it): for errors naming the client's field
FIELD = "client_field"


def image_fields(messages: list[dict[str, Any]]) -> list[str]:
    """The client's fields of the translated ``messages``' images, in order."""
    return [part[FIELD] for message in messages if isinstance(message.get("content"), list)
            for part in message["content"] if part.get("type") == "image_url"]  # fmt: skip


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    from xinfer.text.chat_template import ChatTemplateError

    template = tokenizer.chat_template_for(tools)
    if template is None:
        raise bad_request("this model has no chat template: use /v1/completions with a plain prompt")
    # OpenAI's developer role took the system role's place; a template that knows only the system role would
    # write "developer" as it is, or refuse it (Qwen3.6's)
    as_system = "developer" not in template.source
    dicts = _with_roles(message_dicts(messages, template.content_format)[0], as_system)
    try:
        text = render_messages(
            template,
            dicts,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except ChatTemplateError as error:
        raise bad_request(f"the chat template rejected the messages: {error}", param="messages") from None
    except TypeError as error:  # an unknown keyword in chat_template_kwargs
        raise bad_request(f"chat_template_kwargs: {error}", param="chat_template_kwargs") from None
    return text


def _with_roles(dicts: list[dict[str, Any]], developer_as_system: bool) -> list[dict[str, Any]]:
    if not developer_as_system:
        return dicts
    return [{**d, "role": "system"} if d.get("role") == "developer" else d for d in dicts]


def encode_prompts(
    tokenizer: Callable[[], Any], prompt: Prompt, vocab_size: int, param: str, add_special_tokens: bool = True
) -> list[list[int]]:
    """A completion or embedding prompt (a string, strings, token ids, or lists of them) as checked token ids.
    ``tokenizer`` is asked for only when there is text to encode (token ids need none)."""
    token_ids = [
        tokenizer().encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else list(p)
        for p in prompt_list(prompt)
    ]
    for i, ids in enumerate(token_ids):
        check_token_ids(ids, vocab_size, param if len(token_ids) == 1 else f"{param}.{i}")
    return token_ids


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if not token_ids:
        raise bad_request("a prompt is empty", param=param)
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:
        raise bad_request(f"token ids must be in [0, {vocab_size}), got {low}..{high}", param=param)
