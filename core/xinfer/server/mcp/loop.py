"""Rounds of MCP tool calls run by the server (``--mcp-tool-calls server``): the model answers;
where every call it makes is to an offered MCP tool, the calls are run, the assistant turn and
the results are added to the conversation, and the model answers again, up to
``--mcp-max-rounds`` rounds (:func:`run_rounds`, for both APIs). The Messages answer keeps each
round's calls and results as ``mcp_tool_use`` / ``mcp_tool_result`` blocks (the shape of
Anthropic's MCP connector); the chat completion lists them in ``mcp_tool_calls``.

A forced ``tool_choice`` applies to the first round only (a call is forced once; then the model
may answer). Usage adds up every round's prompt and output tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from xinfer.engine.async_engine import RequestHandle
from xinfer.engine.output import CompletionOutput
from xinfer.server.chat_run import ChatPrompt, submit_chat
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.mcp.client import MCPUnavailable
from xinfer.server.mcp.config import MCPSettings
from xinfer.server.mcp.requests import Offered, mcp_error
from xinfer.server.messages.answer import MessageAnswer, stop_reason
from xinfer.server.messages.calls import Call
from xinfer.server.messages.responses import (
    ContentBlock,
    MCPToolResultBlock,
    MCPToolUseBlock,
    MessageResponse,
    TextBlock,
    ToolUseBlock,
    message_id,
    usage,
)
from xinfer.server.protocol import ChatCompletionRequest, ChatMessage
from xinfer.server.serving import Serving


@dataclass
class Round:
    reading: Any  # the route's reading of the round's answer (Anthropic blocks, an OpenAI choice)
    calls: list[Call]  # the calls run after it (in the last round: those left to the client)
    results: list[tuple[str, bool]]  # each call's text and whether it failed


@dataclass
class Rounds:
    rounds: list[Round]
    output: CompletionOutput  # the last round's
    chat: ChatCompletionRequest  # the last round's request
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


Reader = Callable[[ChatPrompt, CompletionOutput, RequestHandle, ChatCompletionRequest], tuple[Any, list[Call], str]]


async def run_rounds(
    request: Request, serving: Serving, settings: MCPSettings, chat: ChatCompletionRequest, offered: Offered,
    read: Reader,
) -> Rounds:  # fmt: skip
    """The model answers ``chat`` and its MCP calls are run until it answers without one (``read`` gives a
    round's reading of the answer, its calls and its text)."""
    rounds: list[Round] = []
    totals = [0, 0, 0]
    for round_number in range(settings.max_rounds + 1):
        handle, prompt, body = await submit_chat(request, serving, chat)
        try:
            [output] = await unless_disconnected(request, serving.engine.collect(handle))
        finally:
            serving.engine.release(handle)
        totals = [totals[0] + handle.num_prompt_tokens, totals[1] + handle.num_generated,
                  totals[2] + handle.num_cached_tokens]  # fmt: skip
        reading, calls, text = read(prompt, output, handle, body)
        if not calls or any(c.name not in offered for c in calls) or round_number == settings.max_rounds:
            rounds.append(Round(reading, calls, []))
            return Rounds(rounds, output, chat, *totals)
        results = [await run_call(offered, call) for call in calls]
        rounds.append(Round(reading, calls, results))
        chat = next_round(chat, text, calls, [text for text, _ in results])
    raise AssertionError("the last round returns")


async def answer_with_mcp(
    request: Request, serving: Serving, settings: MCPSettings, chat: ChatCompletionRequest, offered: Offered
) -> MessageResponse:
    """The Messages API's answer: each round's thinking and text, its calls as ``mcp_tool_use`` blocks with
    their ``mcp_tool_result`` blocks, then the last round's blocks."""

    def read(prompt: ChatPrompt, output: CompletionOutput, handle: RequestHandle, body: ChatCompletionRequest):
        blocks, calls = MessageAnswer.read(prompt, output)
        return blocks, calls, "".join(b.text for b in blocks if isinstance(b, TextBlock))

    done = await run_rounds(request, serving, settings, chat, offered, read)
    content: list[ContentBlock] = []
    for step in done.rounds[:-1]:
        content += [
            b for b in step.reading if not isinstance(b, ToolUseBlock) and not (isinstance(b, TextBlock) and not b.text)
        ]
        for call, (text, is_error) in zip(step.calls, step.results):
            server = offered[call.name][0].name
            content.append(MCPToolUseBlock(id=call.id, name=call.name, server_name=server, input=call.input))
            content.append(MCPToolResultBlock(tool_use_id=call.id, is_error=is_error, content=[TextBlock(text=text)]))
    content += done.rounds[-1].reading
    reason, sequence = stop_reason(done.output, done.chat.stop_strings)
    if done.rounds[-1].calls and reason == "end_turn":
        reason = "tool_use"  # calls left to the client (not all the model's calls were to MCP tools), or rounds ran out
    return MessageResponse(id=message_id(), model=serving.model_name, content=content, stop_reason=reason,
                           stop_sequence=sequence, usage=usage(done.prompt_tokens, done.output_tokens,
                                                               done.cached_tokens))  # fmt: skip


async def run_call(offered: Offered, call: Call) -> tuple[str, bool]:
    server = offered[call.name][0]
    try:
        result = await server.call(call.name, call.input)
    except MCPUnavailable as error:
        raise mcp_error(error) from None
    return result.text, result.is_error


def next_round(chat: ChatCompletionRequest, text: str, calls: list[Call], results: list[str]) -> ChatCompletionRequest:
    """The conversation with the model's calls and their results added (the calls as the assistant turn's
    ``tool_calls``, which the chat template renders its own way)."""
    tool_calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.input)}}
                  for c in calls]  # fmt: skip
    turns: list[dict[str, Any]] = [{"role": "assistant", "content": text, "tool_calls": tool_calls}]
    turns += [{"role": "tool", "tool_call_id": c.id, "content": r} for c, r in zip(calls, results)]
    messages = [*chat.messages, *(ChatMessage.model_validate_json(json.dumps(t)) for t in turns)]
    forced = chat.tool_choice not in (None, "auto", "none")
    return chat.model_copy(update={"messages": messages, "tool_choice": "auto" if forced else chat.tool_choice})
