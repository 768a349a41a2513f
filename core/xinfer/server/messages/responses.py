"""Response bodies and stream events of the Messages API, in Anthropic's shapes."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


class Usage(BaseModel):
    """``input_tokens`` excludes the prompt tokens read from the prefix cache, as Anthropic counts them."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> Usage:
    return Usage(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                 cache_read_input_tokens=cached_tokens)  # fmt: skip


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing signs a local model's reasoning


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class MCPToolUseBlock(BaseModel):
    """A call of an MCP tool that the server ran (the shape of Anthropic's MCP connector)."""

    type: Literal["mcp_tool_use"] = "mcp_tool_use"
    id: str
    name: str
    server_name: str
    input: dict[str, Any]


class MCPToolResultBlock(BaseModel):
    type: Literal["mcp_tool_result"] = "mcp_tool_result"
    tool_use_id: str
    is_error: bool = False
    content: list[TextBlock]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock | MCPToolUseBlock | MCPToolResultBlock


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock] = Field(default_factory=list)
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int
