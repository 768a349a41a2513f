"""A chat request's prompt, rendered through the model's chat template, and its submission:
shared by ``/v1/chat/completions`` and the Messages API."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from xinfer.engine.async_engine import RequestHandle
from xinfer.multimodal.inputs import PlaceholderRange
from xinfer.server.errors import bad_request
from xinfer.server.prompts import check_token_ids, message_dicts, render_chat
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.serving import Serving
from xinfer.server.tools import ToolUse, tool_use
from xinfer.text.reasoning import ReasoningTags, opens_reasoning
from xinfer.toolcalls import ToolParser


@dataclass(frozen=True)
class ChatPrompt:
    text: str
    token_ids: list[int]  # each image's placeholder expanded
    multimodal: list[PlaceholderRange]  # where the images go
    tags: ReasoningTags | None  # the model's reasoning tags, where its reasoning is split out
    inside: bool  # the prompt opened a reasoning block: the output starts inside it
    tools: ToolUse = field(default_factory=ToolUse)  # the tools the template got, and the parser of the answer's calls

    @property
    def tool_parser(self) -> ToolParser | None:
        return self.tools.parser

    @property
    def thinks(self) -> bool:
        """Whether the model reasons in this answer (the template has not closed its block)."""
        return self.tags is not None and (self.inside or not self.text.rstrip().endswith(self.tags.end))


def with_tools(serving: Serving, body: ChatCompletionRequest) -> tuple[ChatCompletionRequest, ToolUse]:
    """How the request uses tools; its body decoded with special tokens where the parser's markers are some."""
    tools = tool_use(body.tools, body.tool_choice, body.parallel_tool_calls, serving.tool_family)
    if tools.parser is not None and tools.parser.keeps_special_tokens:
        body = body.model_copy(update={"skip_special_tokens": False})
    return body, tools


async def chat_prompt(serving: Serving, body: ChatCompletionRequest, tools: ToolUse | None = None) -> ChatPrompt:
    """``tools``: as :func:`with_tools` found them (None: no tools go to the template)."""
    tools = tools or ToolUse()
    urls = body.with_image_fields(message_dicts(body.messages)[1])
    images = await serving.images(urls) if urls else []

    def rendered() -> tuple[str, list[int]]:
        text = render_chat(
            serving.tokenizer,
            body.messages,
            body.add_generation_prompt,
            body.continue_final_message,
            tools.template_tools,
            template_kwargs(body, serving.disable_reasoning),
        )
        return text, serving.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself

    text, token_ids = await asyncio.to_thread(rendered)  # (seconds for megabytes: off the event loop)
    check_token_ids(token_ids, serving.vocab_size, "messages")
    if body.truncate_prompt_tokens is not None:
        if images:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images", param="truncate_prompt_tokens")
        token_ids = body.truncated(token_ids, serving.max_model_len)
    tags = serving.reasoning_tags
    token_ids, multimodal = (
        await serving.multimodal_prompt(token_ids, images, body.prompt_name) if images else (token_ids, [])
    )
    return ChatPrompt(text, token_ids, multimodal, tags, tags is not None and opens_reasoning(text, tags), tools)


async def submit_chat(
    request: Request, serving: Serving, body: ChatCompletionRequest
) -> tuple[RequestHandle, ChatPrompt, ChatCompletionRequest]:
    """The request queued; its prompt; its body as run (see :func:`with_tools`)."""
    body, tools = with_tools(serving, body)
    prompt = await chat_prompt(serving, body, tools)
    # a model that reasons here: a constraint waits for the block's end
    end_id = serving.tokenizer.token_to_id(prompt.tags.end) if prompt.tags is not None and prompt.thinks else None
    entries = serving.engine_entries(body, [prompt.token_ids], prompt.multimodal, after_token_id=end_id)
    handle = await serving.submit(request, entries)
    return handle, prompt, body


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
