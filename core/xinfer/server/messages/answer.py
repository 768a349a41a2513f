"""The answer to a Messages request: one message, or Anthropic's event stream
(``message_start``, per content block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, a ``ping`` after the first block opens, ``message_delta`` with the stop
reason and usage, ``message_stop``; ``error`` if the engine fails mid-way)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xinfer.engine.async_engine import EngineUnavailable, RequestHandle
from xinfer.engine.output import CompletionOutput
from xinfer.server.chat_run import ChatPrompt
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import anthropic_error_body
from xinfer.server.messages.responses import (
    ContentBlock,
    MessageResponse,
    TextBlock,
    ThinkingBlock,
    Usage,
    message_id,
    sse,
    usage,
)
from xinfer.server.serving import Serving
from xinfer.server.streaming import EngineStreamResponse
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
    return output.finish_reason, None  # "abort": the server shut down before the answer ended


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
        return MessageResponse(id=self.id, model=self.serving.model_name, content=content, stop_reason=reason,
                               stop_sequence=sequence, usage=self.usage())  # fmt: skip

    def blocks(self, output: CompletionOutput) -> list[ContentBlock]:
        tags = self.prompt.tags
        reasoning, text = split(output.text, tags, self.prompt.inside) if tags else (None, output.text)
        content: list[ContentBlock] = [ThinkingBlock(thinking=reasoning)] if reasoning is not None else []
        if text or not content:
            content.append(TextBlock(text=text))
        return content

    async def respond(self, request: Request, stream: bool) -> Response:
        engine = self.serving.engine
        if stream:
            return EngineStreamResponse(self.events(), engine, self.handle)
        try:
            [output] = await unless_disconnected(request, engine.collect(self.handle))
            return JSONResponse(self.message(self.blocks(output), output).model_dump())
        finally:
            engine.release(self.handle)

    async def events(self) -> AsyncIterator[str]:
        start = self.message([], None).model_dump()
        yield sse("message_start", {"type": "message_start", "message": start})
        blocks = BlockStream()
        tags = self.prompt.tags
        split_stream = ReasoningStream(tags, self.prompt.inside) if tags else None
        last: CompletionOutput | None = None
        try:
            async for _, out in self.serving.engine.stream(self.handle):
                reasoning, text = "", out.text
                if split_stream is not None:
                    reasoning, text = split_stream.push(out.text)
                    if out.finished:
                        more_reasoning, more_text = split_stream.finish()
                        reasoning, text = reasoning + more_reasoning, text + more_text
                for event in (*blocks.write("thinking", reasoning), *blocks.write("text", text)):
                    yield event
                last = out if out.finished else last
        except EngineUnavailable as error:
            yield sse("error", anthropic_error_body(503, str(error)))
            return
        for event in blocks.finish():
            yield event
        reason, sequence = stop_reason(last, self.stop_sequences) if last is not None else (None, None)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield sse("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage().model_dump()})
        yield sse("message_stop", {"type": "message_stop"})


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
            sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}),
        ]

    def open(self, kind: str, block: dict[str, Any] | None = None) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block or BLOCK_STARTS[kind]}
        events.append(sse("content_block_start", start))
        if self.index == 0:
            events.append(sse("ping", {"type": "ping"}))
        return events

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def finish(self) -> list[str]:
        return (self.open("text") if self.index < 0 else []) + self.close()
