"""The answer to a Messages request: one message, or Anthropic's event stream
(``message_start``, per content block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, a ``ping`` after the first block opens, ``message_delta`` with the stop
reason and usage, ``message_stop``; ``error`` if the engine fails mid-way)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xinfer.engine.async_engine import RequestHandle
from xinfer.engine.output import CompletionOutput
from xinfer.server.chat_run import ChatPrompt
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import ANTHROPIC_PATHS, server_failure
from xinfer.server.messages.calls import read_calls
from xinfer.server.messages.responses import (
    ContentBlock,
    MessageResponse,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
    Usage,
    message_id,
    usage,
)
from xinfer.server.serving import Serving
from xinfer.server.streaming import EngineStreamResponse, typed_sse_event
from xinfer.server.tools import Call, calls_given
from xinfer.text.reasoning import ReasoningStream, split

# a block's empty start, and the delta type that extends it, by block type
BLOCK_STARTS: dict[str, dict[str, Any]] = {"text": {"type": "text", "text": ""},
                                           "thinking": {"type": "thinking", "thinking": "", "signature": ""}}  # fmt: skip
DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


def stop_reason(output: CompletionOutput, stop_sequences: list[str]) -> tuple[str | None, str | None]:
    """(Anthropic's stop reason, the stop sequence that ended the output) of a finished output."""
    if output.finish_reason == "length":
        return "max_tokens", None
    if output.finish_reason == "stop":
        if isinstance(output.stop_reason, str) and output.stop_reason in stop_sequences:
            return "stop_sequence", output.stop_reason
        return "end_turn", None
    return output.finish_reason, None  # a request failed or cut off at shutdown raises instead


class MessageAnswer:
    def __init__(self, serving: Serving, handle: RequestHandle, prompt: ChatPrompt, stop_sequences: list[str]):
        self.serving, self.handle, self.prompt = serving, handle, prompt
        self.stop_sequences = stop_sequences
        self.id = message_id()

    def usage(self) -> Usage:
        handle = self.handle
        return usage(handle.num_prompt_tokens, handle.num_generated, handle.num_cached_tokens)

    def message(self, content: list[ContentBlock], output: CompletionOutput | None) -> MessageResponse:
        reason, sequence = stop_reason(output, self.stop_sequences) if output is not None else (None, None)
        if reason == "end_turn" and any(isinstance(block, ToolUseBlock) for block in content):
            reason = "tool_use"
        return MessageResponse(id=self.id, model=self.serving.model_name, content=content, stop_reason=reason,
                               stop_sequence=sequence, usage=self.usage())  # fmt: skip

    @staticmethod
    def read(prompt: ChatPrompt, output: CompletionOutput) -> tuple[list[ContentBlock], list[Call]]:
        """A finished output's blocks (thinking, text, tool calls) and its tool calls."""
        tags, text = prompt.tags, output.text
        reasoning, text = split(text, tags, prompt.inside) if tags else (None, text)
        text, calls = read_calls(prompt, text)
        content: list[ContentBlock] = [ThinkingBlock(thinking=reasoning)] if reasoning is not None else []
        if text or not (content or calls):
            content.append(TextBlock(text=text))
        content += [ToolUseBlock(id=tool_use_id(call.id), name=call.name, input=call.input) for call in calls]
        return content, calls

    async def respond(self, request: Request, stream: bool) -> Response:
        engine = self.serving.engine
        if stream:
            return EngineStreamResponse(self.events(), engine, self.handle)
        try:
            [output] = await unless_disconnected(request, engine.collect(self.handle))
            return JSONResponse(self.message(self.read(self.prompt, output)[0], output).model_dump())
        finally:
            engine.release(self.handle)

    def start_event(self) -> str:
        return typed_sse_event(
            "message_start", {"type": "message_start", "message": self.message([], None).model_dump()}
        )

    async def events(self) -> AsyncIterator[str]:
        started = False  # message_start waits for the first output: its usage counts the prompt's cached tokens
        blocks = BlockStream()
        prompt = self.prompt
        split_stream = ReasoningStream(prompt.tags, prompt.inside) if prompt.tags else None
        parser = prompt.tool_parser
        # a tool_use block's input must be an object: a call goes out whole, once its block closed and proved valid
        call_stream = parser.stream(hold=True) if parser is not None else None
        sent = 0  # the calls that went out
        last: CompletionOutput | None = None
        try:
            async for _, out in self.serving.engine.stream(self.handle):
                if not started:
                    started = True
                    yield self.start_event()
                reasoning, text = "", out.text
                if split_stream is not None:
                    reasoning, text = split_stream.push(text)
                    if out.finished():
                        more_reasoning, more_text = split_stream.finish()
                        reasoning, text = reasoning + more_reasoning, text + more_text
                calls: list[Call] = []
                if call_stream is not None:
                    deltas = [call_stream.push(text)] + ([call_stream.finish()] if out.finished() else [])
                    text = "".join(d.content for d in deltas)
                    given = calls_given(prompt.tools, call_stream.calls)
                    calls, sent = given[sent:], len(given)
                for event in (*blocks.write("thinking", reasoning), *blocks.write("text", text)):
                    yield event
                for call in calls:
                    for event in blocks.write_call(call):
                        yield event
                last = out if out.finished() else last
        except Exception as error:  # noqa: BLE001 - the client gets an error event, not a cut stream
            yield typed_sse_event("error", server_failure(error, "a messages stream").body(ANTHROPIC_PATHS))
            return
        if not started:
            yield self.start_event()
        for event in blocks.finish():
            yield event
        reason, sequence = stop_reason(last, self.stop_sequences) if last is not None else (None, None)
        if reason == "end_turn" and call_stream is not None and call_stream.calls:
            reason = "tool_use"
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield typed_sse_event(
            "message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage().model_dump()}
        )
        yield typed_sse_event("message_stop", {"type": "message_stop"})


class BlockStream:
    """Content blocks as events: a block opens with its first text and closes when a block of another kind
    starts or the message ends; a message without any gets one empty text block."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def write(self, kind: str, text: str) -> list[str]:
        if not text:
            return []
        events = self.open(kind) if kind != self.kind else []
        delta_type, field = DELTAS[kind]
        delta = {"type": delta_type, field: text}
        return [
            *events,
            typed_sse_event(
                "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
            ),
        ]

    def write_call(self, call: Call) -> list[str]:
        """A whole tool call: a ``tool_use`` block whose input (the object the whole message gives) is one
        ``input_json_delta``."""
        events = self.open("tool_use", {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": {}})
        delta = {"type": "input_json_delta", "partial_json": json.dumps(call.input)}
        events.append(
            typed_sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
        )
        return events

    def open(self, kind: str, block: dict[str, Any] | None = None) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block or BLOCK_STARTS[kind]}
        events.append(typed_sse_event("content_block_start", start))
        if self.index == 0:
            events.append(typed_sse_event("ping", {"type": "ping"}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [typed_sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def finish(self) -> list[str]:
        return (self.open("text") if self.index < 0 else []) + self.close()


def message_events(message: MessageResponse) -> list[str]:
    """A whole message as Anthropic's event stream: each block in one delta (a tool call's input as JSON)."""
    start = message.model_copy(update={"content": [], "stop_reason": None, "stop_sequence": None})
    events = [typed_sse_event("message_start", {"type": "message_start", "message": start.model_dump()})]
    for index, block in enumerate(message.content):
        whole = block.model_dump()
        if isinstance(block, TextBlock | ThinkingBlock):
            kind, (delta_type, field) = block.type, DELTAS[block.type]
            empty, delta = BLOCK_STARTS[kind], {"type": delta_type, field: whole[field]}
        elif isinstance(block, ToolUseBlock):
            empty, delta = whole | {"input": {}}, {"type": "input_json_delta", "partial_json": json.dumps(block.input)}
        else:  # an MCP call or result the server ran: whole in its start
            empty, delta = whole, None
        events.append(
            typed_sse_event(
                "content_block_start", {"type": "content_block_start", "index": index, "content_block": empty}
            )
        )
        if index == 0:
            events.append(typed_sse_event("ping", {"type": "ping"}))
        if delta is not None:
            events.append(
                typed_sse_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
            )
        events.append(typed_sse_event("content_block_stop", {"type": "content_block_stop", "index": index}))
    end = {"stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence}
    events.append(
        typed_sse_event("message_delta", {"type": "message_delta", "delta": end, "usage": message.usage.model_dump()})
    )
    events.append(typed_sse_event("message_stop", {"type": "message_stop"}))
    return events


def tool_use_id(call_id: str) -> str:
    """A tool call's id as Anthropic spells one (``toolu_...``; the parsers write OpenAI's ``call_...``)."""
    return "toolu_" + call_id.removeprefix("call_")
