"""A chat completion after rounds of MCP calls (:mod:`xinfer.server.mcp.loop`): the message's
``content`` and ``reasoning_content`` are every round's, ``mcp_calls`` (xinfer's extra) the calls
the server ran with their results, and ``tool_calls`` the final round's calls left to the client.

Streamed, each round's content and reasoning go out as they are generated; a round's tool-call
deltas are held until the round ends, then sent as ``tool_calls`` (calls for the client: the last
round) or, once run, as one delta of ``mcp_calls``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from xinfer.engine.async_engine import RequestHandle
from xinfer.server.chat_answer import ChatAnswer, finish_reason
from xinfer.server.chat_run import ChatPrompt
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import server_failure
from xinfer.server.mcp.loop import MCPRounds, RanCall
from xinfer.server.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
    MCPCallItem,
    ToolCallDeltaItem,
    Usage,
    new_id,
    usage,
)
from xinfer.server.streaming import SSE_DONE, SSE_HEADERS, sse_event
from xinfer.server.tools import Call, calls_given


async def chat_with_mcp(rounds: MCPRounds, stream: bool) -> Response:
    first = await rounds.submit()  # before any answer: a bad request is still an HTTP error
    if stream:
        return StreamingResponse(ChatRounds(rounds).events(first), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse((await ChatRounds(rounds).whole(first)).model_dump())


def mcp_items(ran: list[RanCall], first_index: int | None = None) -> list[MCPCallItem]:
    """The calls run; streamed, each numbered (from ``first_index``, counting on across rounds) as a
    ``tool_calls`` delta's entries are, which is how clients merge a list sent over several deltas."""
    return [MCPCallItem(index=None if first_index is None else first_index + i, id=r.call.id, server_name=r.server,
                        name=r.call.name, arguments=json.dumps(r.call.input), output=r.output, is_error=r.is_error)
            for i, r in enumerate(ran)]  # fmt: skip


class ChatRounds:
    def __init__(self, rounds: MCPRounds):
        self.rounds = rounds
        self.serving = rounds.serving
        self.id = new_id("chatcmpl")
        self.reasoning_tokens = 0  # every round's

    def answer(self, handle: RequestHandle, prompt: ChatPrompt) -> ChatAnswer:
        return ChatAnswer(self.serving, self.rounds.body, handle, prompt.tags, prompt.inside, prompt.tools)

    def usage(self) -> Usage:
        rounds = self.rounds
        return usage(rounds.prompt_tokens, rounds.output_tokens, rounds.cached_tokens, self.reasoning_tokens)

    async def whole(self, first: tuple[RequestHandle, ChatPrompt]) -> ChatCompletion:
        rounds, engine = self.rounds, self.serving.engine
        contents: list[str] = []
        reasonings: list[str] = []
        ran: list[RanCall] = []
        handle, prompt = first
        while True:
            try:
                [output] = await unless_disconnected(rounds.request, engine.collect(handle))
            finally:
                engine.release(handle)
            rounds.count(handle)
            answer = self.answer(handle, prompt)
            self.reasoning_tokens += answer.reasoning_tokens()
            choice = answer.choice(0, output)
            message = choice.message
            contents.append(message.content or "")
            reasonings += [message.reasoning_content] if message.reasoning_content is not None else []
            calls = [Call.of(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
            if not rounds.runs([c.name for c in calls], output.finish_reason):
                break
            ran += await rounds.run(message.content or "", calls)
            handle, prompt = await rounds.submit()
        content = "".join(contents)
        message = message.model_copy(update={
            "content": content if content or not message.tool_calls else None,
            "reasoning_content": "".join(reasonings) if reasonings else None,
            "mcp_calls": mcp_items(ran),
        })  # fmt: skip
        choice = ChatChoice(
            index=0, message=message, finish_reason=choice.finish_reason, stop_reason=choice.stop_reason
        )
        return ChatCompletion(id=self.id, model=self.serving.model_name, choices=[choice], usage=self.usage())

    def chunk(
        self,
        delta: Delta,
        reason: str | None = None,
        with_usage: bool = False,
        logprobs: ChatLogprobs | None = None,
        stop_reason: str | int | None = None,
    ) -> str:
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=logprobs, finish_reason=reason, stop_reason=stop_reason)
        choices = [choice] if not with_usage else []
        usage = self.usage() if with_usage else None
        return sse_event(ChatCompletionChunk(id=self.id, model=self.serving.model_name, choices=choices, usage=usage))

    async def events(self, first: tuple[RequestHandle, ChatPrompt]) -> AsyncIterator[str]:
        rounds, engine = self.rounds, self.serving.engine
        handle, prompt = first
        sent = 0  # the MCP calls streamed so far
        yield self.chunk(Delta(role="assistant", content=""))
        try:
            while True:
                try:
                    answer = self.answer(handle, prompt)
                    held: list[ToolCallDeltaItem] = []  # the round's call pieces, sent once it is known whose they are
                    content, reason, stop_reason = "", None, None
                    async for choice in answer.deltas():
                        held += choice.delta.tool_calls or []
                        content += choice.delta.content or ""
                        if choice.finish_reason is not None:
                            reason, stop_reason = choice.finish_reason, choice.stop_reason
                        delta = choice.delta.model_copy(update={"tool_calls": None})
                        if delta.content or delta.reasoning_content or choice.logprobs is not None:
                            yield self.chunk(delta, logprobs=choice.logprobs)
                finally:
                    engine.release(handle)
                rounds.count(handle)
                self.reasoning_tokens += answer.reasoning_tokens()
                streamed = answer.call_streams[0]
                found = streamed.calls if streamed is not None else []
                calls = calls_given(answer.tools, found)
                if not rounds.runs([c.name for c in calls], reason):
                    break
                ran = await rounds.run(content, calls)
                yield self.chunk(Delta(mcp_calls=mcp_items(ran, first_index=sent)))
                sent += len(ran)
                handle, prompt = await rounds.submit()
            yield self.chunk(
                Delta(tool_calls=held or None),
                finish_reason(reason, bool(calls) and answer.tools.finishes_with_calls) if reason else None,
                stop_reason=stop_reason,
            )
            if rounds.body.include_usage:
                yield self.chunk(Delta(), with_usage=True)
        except Exception as error:  # noqa: BLE001 - the client gets an error event, not a cut stream
            yield sse_event(server_failure(error, "an MCP chat stream").body())
        yield SSE_DONE
