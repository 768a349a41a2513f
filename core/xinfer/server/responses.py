"""Response bodies of the HTTP API, in OpenAI's shapes."""

from __future__ import annotations

import time
import uuid
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer, model_validator


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None, reasoning_tokens: int | None = None
) -> Usage:
    details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
    reasoning = CompletionTokensDetails(reasoning_tokens=reasoning_tokens) if reasoning_tokens is not None else None
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
        completion_tokens_details=reasoning,
    )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's scores (``prompt_logprobs``), keyed by token id."""

    logprob: float
    rank: int | None = None  # among the whole vocabulary (1: the likeliest); None: below the top asked for
    decoded_token: str


# per prompt token (None for the first, which nothing precedes), its own token and the likeliest, by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallItem(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class MCPCallItem(BaseModel):
    """An MCP tool call the server ran (xinfer's extra), with its result."""

    index: int | None = Field(default=None, exclude_if=lambda value: value is None)  # streamed: as tool_calls' entries
    id: str
    type: Literal["mcp"] = "mcp"
    server_name: str
    name: str
    arguments: str  # JSON text
    output: str
    is_error: bool = False


class Reasoning(BaseModel):
    """The reasoning under both names clients read: ``reasoning_content`` (DeepSeek's, which most clients read) and
    ``reasoning`` (what vLLM sends since it followed OpenAI's guidance for gpt-oss)."""

    reasoning_content: str | None = Field(default=None, exclude_if=lambda value: value is None)

    @model_serializer(mode="wrap")
    def _also_as_reasoning(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        fields = handler(self)
        if self.reasoning_content is not None:
            fields["reasoning"] = self.reasoning_content
        return fields


class AssistantMessage(Reasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallItem] | None = Field(default=None, exclude_if=lambda value: value is None)
    mcp_calls: list[MCPCallItem] | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda value: value is None)  # vLLM's


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda value: value is None)  # vLLM's


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda value: value is None)
    arguments: str = ""


class ToolCallDeltaItem(BaseModel):
    """A piece of a streamed call: the first carries its id, type and name."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda value: value is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda value: value is None)
    function: FunctionCallDelta


class Delta(Reasoning):
    """Only what changed: later chunks carry no role, the last one may be ``{}``."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda value: value is None)
    content: str | None = Field(default=None, exclude_if=lambda value: value is None)
    tool_calls: list[ToolCallDeltaItem] | None = Field(default=None, exclude_if=lambda value: value is None)
    mcp_calls: list[MCPCallItem] | None = Field(default=None, exclude_if=lambda value: value is None)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's, on the finishing chunk
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda value: value is None)  # vLLM's


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # vLLM's, on a choice's first chunk (where asked): after usage, as a chunk's JSON is written up to its choices once
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda value: value is None)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # vLLM's return_token_ids: the prompt's (streamed: on the choice's first chunk) and the tokens generated
    prompt_token_ids: list[int] | None = Field(default=None, exclude_if=lambda value: value is None)
    token_ids: list[int] | None = Field(default=None, exclude_if=lambda value: value is None)


class Completion(BaseModel):
    """A whole completion, or (with ``usage`` None) one streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "xinfer"
    root: str | None = None
    max_model_len: int | None = None
    # what a prompt may hold: ["text"], or ["text", "image"] for a model that takes images
    # (the field OpenRouter's model list uses; vLLM's card has none)
    input_modalities: list[str] = Field(default_factory=lambda: ["text"])
    # what Anthropic's client reads of a model (the route answers both APIs' clients)
    type: Literal["model"] = "model"
    display_name: str = ""
    created_at: str = ""  # RFC 3339
    lifecycle: Literal["active"] = "active"
    # the longest prompt and the largest max_tokens: each leaves the other one token of the context
    max_input_tokens: int | None = None
    max_tokens: int | None = None

    @model_validator(mode="after")
    def _anthropic_fields(self) -> ModelCard:
        self.display_name = self.display_name or self.id
        self.created_at = self.created_at or datetime.fromtimestamp(self.created, timezone.utc).isoformat()
        if self.max_model_len is not None:
            self.max_input_tokens = self.max_tokens = self.max_model_len - 1
        return self


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
    has_more: bool = False  # Anthropic's page fields
    first_id: str | None = None
    last_id: str | None = None

    @model_validator(mode="after")
    def _page_ends(self) -> ModelList:
        if self.data:
            self.first_id, self.last_id = self.data[0].id, self.data[-1].id
        return self


class TokenizeResult(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResult(BaseModel):
    prompt: str
