"""A generation request's answer: one JSON body, or server-sent events tied to its engine request, as OpenAI
streams them: ``data: {json}`` blocks, then ``data: [DONE]``."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from xinfer.engine.async_engine import AsyncEngine, RequestHandle
from xinfer.engine.output import CompletionOutput
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import server_failure
from xinfer.server.logprobs import prompt_logprobs
from xinfer.server.protocol import SamplingFields
from xinfer.server.responses import ChatChunkChoice, CompletionChoice, PromptLogprobs, Usage, new_id, usage
from xinfer.server.serving import Serving

SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_NO_CHOICES = '[],"usage":null}'  # how a chunk's JSON without choices or usage ends
StreamedChoice = CompletionChoice | ChatChunkChoice


def sse_event(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


def typed_sse_event(event: str, data: BaseModel | dict[str, Any]) -> str:
    """One server-sent event as Anthropic's and OpenAI's Responses API write them: its type named
    twice, in ``event:`` and the JSON."""
    payload = data.model_dump_json() if isinstance(data, BaseModel) else json.dumps(data, ensure_ascii=False)
    return f"event: {event}\ndata: {payload}\n\n"


class EngineStreamResponse(StreamingResponse):
    """SSE whose engine request is released however the response ends: finished,
    client gone (Starlette cancels the stream), or never started at all."""

    def __init__(self, events: AsyncIterator[str], engine: AsyncEngine, handle: RequestHandle):
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self.engine = engine
        self.handle = handle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.engine.release(self.handle)


class Answer(ABC):
    """The answer to a chat or completion request: its choices whole, or streamed as they grow."""

    id_prefix: ClassVar[str]
    whole_type: ClassVar[type[BaseModel]]  # the answer collected whole
    chunk_type: ClassVar[type[BaseModel]]  # one streamed chunk of it

    def __init__(self, serving: Serving, body: SamplingFields, handle: RequestHandle):
        self.serving = serving
        self.body = body
        self.handle = handle
        self.id = new_id(self.id_prefix)
        # every chunk's JSON up to its choices, written once (one `created` for all chunks, as OpenAI's): a chunk
        # per token serializes only its choices and usage, not the whole chunk model again
        envelope = self.chunk_type(id=self.id, model=serving.model_name, choices=[], usage=None).model_dump_json()
        assert envelope.endswith(_NO_CHOICES), "chunk_type's last fields are choices and usage (but those left out)"
        self._chunk_head = "data: " + envelope.removesuffix(_NO_CHOICES) + "["

    @abstractmethod
    def choice(self, index: int, output: CompletionOutput) -> BaseModel:
        """Choice ``index``, finished, as the whole answer shows it."""

    @abstractmethod
    def events(self) -> AsyncIterator[str]:
        """The streamed chunks of the choices, up to their last tokens."""

    async def respond(self, request: Request) -> Response:
        engine = self.serving.engine
        if self.body.stream:
            return EngineStreamResponse(self._stream(), engine, self.handle)
        try:
            outputs = await unless_disconnected(request, engine.collect(self.handle))
            choices = [self.choice(index, output) for index, output in enumerate(outputs)]
            return JSONResponse(self.whole(choices).model_dump())
        finally:
            engine.release(self.handle)

    def whole(self, choices: list[Any]) -> BaseModel:
        return self.whole_type(id=self.id, model=self.serving.model_name, choices=choices, usage=self.usage())

    def prompt_logprobs(self, position: int) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` of the request's prompt ``position``, where asked for."""
        output, top = self.handle.outputs[position], self.body.prompt_logprobs
        if top is None or output.prompt_logprobs is None:
            return None
        return prompt_logprobs(output.prompt_logprobs, self.serving.token_text)

    def usage(self) -> Usage:
        handle = self.handle
        return usage(handle.num_prompt_tokens, handle.num_generated, handle.num_cached_tokens, self.reasoning_tokens())

    def reasoning_tokens(self) -> int | None:
        """Output tokens spent reasoning (``completion_tokens_details``); None: not counted (a completion)."""
        return None

    def streamed_usage(self, index: int) -> Usage:
        """vLLM's continuous usage on a chunk of choice ``index``: its own prompt's tokens and the tokens it has
        streamed (those the engine made since are not yet counted)."""
        output = self.handle.outputs[index // self.body.n]
        return usage(len(output.prompt_token_ids), len(output.outputs[index % self.body.n].token_ids))

    def chunk(self, choice: StreamedChoice, prompt_token_ids: list[int] | None = None) -> str:
        """``chunk_type``'s event of ``choice`` (with the choice's usage so far where continuous usage is asked;
        ``prompt_token_ids``: chat's, on a choice's first chunk)."""
        usage = self.streamed_usage(choice.index).model_dump_json() if self.body.continuous_usage else "null"
        ids = f',"prompt_token_ids":{json.dumps(prompt_token_ids)}' if prompt_token_ids is not None else ""
        return f'{self._chunk_head}{choice.model_dump_json()}],"usage":{usage}{ids}}}\n\n'

    def usage_chunk(self) -> str:
        """The last chunk: no choices, the whole request's usage."""
        return f'{self._chunk_head}],"usage":{self.usage().model_dump_json()}}}\n\n'

    async def _stream(self) -> AsyncIterator[str]:
        try:
            async for event in self.events():
                yield event
        except Exception as error:  # noqa: BLE001 - the client gets an error event, not a cut stream
            yield sse_event(server_failure(error, f"a {self.id_prefix} stream").body())
        else:
            if self.body.include_usage:
                yield self.usage_chunk()
        yield SSE_DONE
