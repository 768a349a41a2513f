"""Response objects of OpenAI's Responses API: the ``response``, its output items, usage."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from xinfer.server.responses import CompletionTokensDetails, PromptTokensDetails, TokenLogprob, Usage

ItemStatus = Literal["in_progress", "completed", "incomplete"]  # an output item's
Status = Literal[ItemStatus, "failed"]  # a response's


def item_id(prefix: str) -> str:
    """OpenAI's ids: ``resp_...`` for responses, ``msg_...`` for messages, ``rs_...`` for reasoning,
    ``fc_...`` for function calls."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    """``logprobs``: those of the message's tokens, where ``include`` asks for them."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[TokenLogprob] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningItem(BaseModel):
    """The model's reasoning, whole in ``content`` (nothing summarizes it)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText]


class FunctionCallItem(BaseModel):
    """A call the model made: ``call_id`` is what the client's ``function_call_output`` names."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem


class InputTokensDetails(PromptTokensDetails):
    # prefix caching is automatic and free: no token is written to a cache at the client's request, as
    # cache_creation_input_tokens is 0 on the Messages API
    cache_write_tokens: int = 0


class ResponseUsage(BaseModel):
    """``input_tokens`` includes the prompt tokens read from the prefix cache, as OpenAI counts them."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: CompletionTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, chat: Usage) -> ResponseUsage:
        cached = chat.prompt_tokens_details.cached_tokens if chat.prompt_tokens_details else 0
        reasoning = chat.completion_tokens_details.reasoning_tokens if chat.completion_tokens_details else 0
        return cls(
            input_tokens=chat.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=chat.completion_tokens,
            output_tokens_details=CompletionTokensDetails(reasoning_tokens=reasoning),
            total_tokens=chat.total_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: Literal["server_error"] = "server_error"
    message: str


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    completed_at: int | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    # what is done where a request could ask for more: refused (truncation auto, background) or the one tier there is
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    service_tier: Literal["default"] = "default"
    store: bool = True
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    max_tool_calls: int | None = None
