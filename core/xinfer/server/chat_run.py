"""A chat request's prompt, rendered through the model's chat template, and its submission:
shared by ``/v1/chat/completions`` and the Messages API."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from xinfer.engine.async_engine import RequestHandle
from xinfer.multimodal.inputs import PlaceholderRange
from xinfer.server.prompts import check_token_ids, message_dicts, render_chat
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.serving import Serving
from xinfer.text.reasoning import ReasoningTags, opens_reasoning


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]  # each image's placeholder expanded
    multimodal: list[PlaceholderRange]  # where the images go
    tags: ReasoningTags | None  # the model's reasoning tags, where its reasoning is split out
    inside: bool  # the prompt opened a reasoning block: the output starts inside it
    tool_parser: Any = None  # what reads the answer's tool calls (None: it is text only)

    @property
    def thinks(self) -> bool:
        """Whether the model reasons in this answer (the template has not closed its block)."""
        return self.tags is not None and (self.inside or not self.text.rstrip().endswith(self.tags.end))


async def chat_prompt(serving: Serving, body: ChatCompletionRequest) -> ChatPrompt:
    _, urls = message_dicts(body.messages)
    images = await serving.images(urls) if urls else []
    text = render_chat(
        serving.tokenizer,
        body.messages,
        body.add_generation_prompt,
        body.continue_final_message,
        body.tools,
        template_kwargs(body, serving.disable_reasoning),
    )
    token_ids = serving.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
    check_token_ids(token_ids, serving.vocab_size, "messages")
    tags = serving.reasoning_tags
    token_ids, multimodal = await serving.multimodal_prompt(token_ids, images) if images else (token_ids, [])
    return ChatPrompt(text, token_ids, multimodal, tags, tags is not None and opens_reasoning(text, tags))


async def submit_chat(
    request: Request, serving: Serving, body: ChatCompletionRequest
) -> tuple[RequestHandle, ChatPrompt]:
    prompt = await chat_prompt(serving, body)
    # a model that reasons here: a constraint waits for the block's end
    end_id = serving.tokenizer.token_to_id(prompt.tags.end) if prompt.tags is not None and prompt.thinks else None
    handle = await serving.submit(request, body, [prompt.token_ids], prompt.multimodal, after_token_id=end_id)
    return handle, prompt


def template_kwargs(body: ChatCompletionRequest, disable_reasoning: bool) -> dict[str, Any]:
    """The chat template's extra variables: the request's own, its ``reasoning_effort``, and
    ``enable_thinking=false`` where reasoning is off (``--disable-reasoning`` or effort
    ``none``) unless the request set it (templates that do not read it ignore it)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
    if disable_reasoning or body.reasoning_effort == "none":
        kwargs.setdefault("enable_thinking", False)
    return kwargs
