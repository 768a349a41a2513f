"""Request bodies of Anthropic's Messages API.

Parsed as the OpenAI bodies are (strict JSON, unknown fields ignored). Content blocks
keep the fields the server reads; a block of a type it cannot use is refused when the
request is translated (:mod:`xinfer.server.messages.convert`), naming the block.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from xinfer.server.errors import FieldError
from xinfer.server.protocol import RequestBody, asks_nothing, check_stop_strings

# Anthropic's fields that ask for what this server does not run: a 400 naming them where set, as ignoring them
# would answer without what was asked for. Those that only change bookkeeping (cache_control, metadata,
# service_tier, speed, inference_geo, diagnostics, user_profile_id, workspace_id) are accepted and ignored.
UNSUPPORTED_FIELDS = {
    "container": "containers (code execution, skills) are not run by this server",
    "mcp_servers": "remote MCP servers are not called by this server: its own (--mcp-*) are offered with mcp: true",
}
MIN_THINKING_BUDGET = 1024


class Source(RequestBody):
    """An image's or a document's source: checked where it is read, as each block takes its own types."""

    type: str | None = None
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class Block(RequestBody):
    """One content block: ``text``, ``image``, ``document``, ``tool_use``, ``tool_result``, ``thinking``, ..."""

    type: str
    text: str | None = None
    source: Source | str | None = None  # a string: a search_result block's, refused with the block
    title: str | None = None  # document
    context: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None


class Message(RequestBody):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(RequestBody):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required of a custom tool; server tools have none
    type: str | None = None  # "custom" or absent; Anthropic's server tools (web_search_..., bash_...) are refused

    @model_validator(mode="after")
    def _custom_tools_have_a_schema(self) -> Tool:
        if self.type in (None, "custom") and self.input_schema is None:
            raise FieldError("input_schema", "Field required")
        return self


class ToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(RequestBody):
    # "enabled", "adaptive", "between_tools": the model thinks as its template lets it (no budget: budget_tokens is
    # not read); "disabled": the template is asked not to think
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=MIN_THINKING_BUDGET)  # Anthropic's bounds, checked as its API does

    @model_validator(mode="after")
    def _budget_when_enabled(self) -> Thinking:
        if self.type == "enabled" and self.budget_tokens is None:
            raise FieldError("budget_tokens", "Field required where thinking is enabled")
        return self


class OutputFormat(RequestBody):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestBody):
    # Anthropic's effort levels; not read (a local model's thinking has no budget)
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None  # structured outputs: the answer follows this JSON schema


class CountTokensRequest(RequestBody):
    """What ``/v1/messages/count_tokens`` reads: the prompt's parts."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # xinfer's extra: offer the tools of the --mcp-* servers (true: all of them; a list: those named)
    mcp: bool | list[str] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _thinking_within_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None and self.thinking.type == "enabled" else None
        if budget is not None and budget >= self.max_tokens:
            raise FieldError("max_tokens", f"must be greater than thinking.budget_tokens ({budget})")
        return self

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, problem in UNSUPPORTED_FIELDS.items():
                if not asks_nothing(data.get(name)):
                    raise FieldError(name, problem)
        return data

    @field_validator("stop_sequences")
    @classmethod
    def _check_stop_sequences(cls, stops: list[str] | None) -> list[str] | None:
        check_stop_strings(stops or [])
        return stops
