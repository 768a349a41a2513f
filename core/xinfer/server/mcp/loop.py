"""Rounds of MCP tool calls run by the server (``--mcp-tool-calls server``), one loop for
``/v1/chat/completions`` and ``/v1/messages``: the model answers; where every call it makes
is to an offered MCP tool (and rounds are left), the calls are run, the assistant turn and the
results are added to the conversation, and the model answers again, up to
``--mcp-max-rounds`` rounds, after which the model answers with no tools (``tool_choice: "none"``): its
MCP calls are never handed to the client, who cannot run them. Each route reads a round's answer (whole or
streamed) and writes the calls run in its own shape.

A forced ``tool_choice`` applies to the first round only (a call is forced once; then the model
may answer). Usage adds up every round's prompt and output tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from xinfer.engine.async_engine import RequestHandle
from xinfer.server.chat_run import ChatPrompt, submit_chat
from xinfer.server.errors import APIError
from xinfer.server.mcp.client import MCPUnavailable
from xinfer.server.mcp.config import MCPSettings
from xinfer.server.mcp.requests import Offered, mcp_error
from xinfer.server.protocol import ChatCompletionRequest, ChatMessage
from xinfer.server.serving import Serving
from xinfer.server.tools import Call


@dataclass(frozen=True)
class RanCall:
    """An MCP call the server ran, with its result."""

    call: Call
    server: str
    output: str
    is_error: bool


class MCPRounds:
    """One request's rounds: :meth:`submit` the next, read its answer, and where :meth:`runs` its
    calls, :meth:`run` them (which adds them and their results to the conversation)."""

    def __init__(self, request: Request, serving: Serving, settings: MCPSettings, chat: ChatCompletionRequest,
                 offered: Offered):  # fmt: skip
        self.request, self.serving, self.settings = request, serving, settings
        self.chat, self.offered = chat, offered
        self.body = chat  # the body the last round ran with (see submit_chat)
        self.rounds_run = 0
        self.ran: list[RanCall] = []  # every round's
        self.prompt_tokens = self.output_tokens = self.cached_tokens = 0

    async def submit(self) -> tuple[RequestHandle, ChatPrompt]:
        try:
            handle, prompt, self.body = await submit_chat(self.request, self.serving, self.next_request())
        except APIError as error:
            if error.code != "context_length_exceeded" or not self.ran:
                raise
            # the conversation outgrew the context through the tools' results, not the client's messages
            results = ", ".join(f"{r.call.name} {len(r.output):,}" for r in self.ran)
            raise APIError(error.status, f"the MCP tools' results (characters: {results}) make the conversation "
                                         f"longer than the model's context: {error.message}", None, error.code) from None  # fmt: skip
        return handle, prompt

    def next_request(self) -> ChatCompletionRequest:
        """The next round's request: the conversation so far, with no tools once the rounds are spent."""
        if self.rounds_run < self.settings.max_rounds:
            return self.chat
        return self.chat.model_copy(update={"tool_choice": "none"})

    def count(self, handle: RequestHandle) -> None:
        """Adds a finished round's tokens to the usage."""
        self.prompt_tokens += handle.num_prompt_tokens
        self.output_tokens += handle.num_generated
        self.cached_tokens += handle.num_cached_tokens

    def runs(self, names: list[str], reason: str | None) -> bool:
        """Whether the server runs a round's calls of these tools: all are MCP tools offered, rounds are
        left, and the round ended by itself (``reason`` "length": the last call may be cut short, its
        arguments unfinished, so no call of that round is run)."""
        offered = bool(names) and all(n in self.offered for n in names)
        return offered and reason != "length" and self.rounds_run < self.settings.max_rounds

    async def run(self, text: str, calls: list[Call]) -> list[RanCall]:
        """Runs ``calls`` one after another (502/504 for a server that fails) and adds the assistant
        turn (``text`` and the calls) and their results to the conversation."""
        ran = []
        for call in calls:
            server = self.offered[call.name][0]
            try:
                result = await server.call(call.name, call.input)
            except MCPUnavailable as error:
                raise mcp_error(error) from None
            ran.append(RanCall(call, server.name, result.text, result.is_error))
        self.ran += ran
        self.chat = next_round(self.chat, text, ran)
        self.rounds_run += 1
        return ran


def next_round(chat: ChatCompletionRequest, text: str, ran: list[RanCall]) -> ChatCompletionRequest:
    """The conversation with the model's calls and their results added (the calls as the assistant turn's
    ``tool_calls``, which the chat template renders its own way)."""
    tool_calls = [{"id": r.call.id, "type": "function",
                   "function": {"name": r.call.name, "arguments": json.dumps(r.call.input)}} for r in ran]  # fmt: skip
    turns: list[dict[str, Any]] = [{"role": "assistant", "content": text, "tool_calls": tool_calls}]
    turns += [{"role": "tool", "tool_call_id": r.call.id, "content": r.output} for r in ran]
    messages = [*chat.messages, *(ChatMessage.model_validate_json(json.dumps(t)) for t in turns)]
    forced = chat.tool_choice not in (None, "auto", "none")
    return chat.model_copy(update={"messages": messages, "tool_choice": "auto" if forced else chat.tool_choice})
