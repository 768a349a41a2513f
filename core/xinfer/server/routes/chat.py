"""``POST /v1/chat/completions``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xinfer.engine.async_engine import EngineUnavailable, RequestHandle
from xinfer.server import sse
from xinfer.server.body import parse_body
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import error_body
from xinfer.server.logprobs import chat_logprobs
from xinfer.server.params import request_params
from xinfer.server.prompts import check_token_ids, encode_chat, render_chat
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
    Usage,
    new_id,
    usage,
)
from xinfer.server.serving import Serving
from xinfer.server.streaming import EngineStreamResponse

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, ChatCompletionRequest)
    serving.check_model(body.model)
    text = render_chat(
        serving.tokenizer,
        body.messages,
        body.add_generation_prompt,
        body.continue_final_message,
        body.tools,
        body.chat_template_kwargs,
    )
    prompt = encode_chat(serving.tokenizer, text)
    check_token_ids(prompt, serving.vocab_size, "messages")
    params = request_params(
        body, serving.defaults, len(prompt), serving.max_model_len, body.token_limit, body.num_logprobs
    )
    handle = await serving.submit(request, [(prompt, params)])
    chat = ChatRun(serving, body, handle)
    if body.stream:
        return EngineStreamResponse(chat.events(), serving.engine, handle)
    try:
        return JSONResponse((await chat.collect(request)).model_dump())
    finally:
        serving.engine.release(handle)


class ChatRun:
    def __init__(self, serving: Serving, body: ChatCompletionRequest, handle: RequestHandle):
        self.serving = serving
        self.body = body
        self.handle = handle
        self.id = new_id("chatcmpl")

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> ChatLogprobs | None:
        if not self.body.logprobs or entries is None:
            return None
        n = self.body.top_logprobs or 0
        return ChatLogprobs(content=chat_logprobs(token_ids, entries, n, self.serving.token_text))

    def usage(self) -> Usage:
        handle = self.handle
        return usage(handle.num_prompt_tokens, handle.num_generated, handle.num_cached_tokens)

    async def collect(self, request: Request) -> ChatCompletion:
        done = await unless_disconnected(request, self.serving.engine.collect(self.handle))
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=choice.text),
                logprobs=self.logprobs(choice.token_ids, choice.logprobs),
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
            )
            for i, choice in enumerate(done)
        ]
        return ChatCompletion(id=self.id, model=self.serving.model_name, choices=choices, usage=self.usage())

    def chunk(self, choices: list[ChatChunkChoice], with_usage: bool = False) -> str:
        chunk = ChatCompletionChunk(id=self.id, model=self.serving.model_name, choices=choices)
        if with_usage:
            chunk.usage = self.usage()
        return sse.event(chunk)

    async def events(self) -> AsyncIterator[str]:
        continuous = self.body.stream_options is not None and self.body.stream_options.continuous_usage_stats
        for index in range(self.body.n):
            yield self.chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        try:
            async for index, out in self.serving.engine.stream(self.handle):
                logprobs = self.logprobs(out.token_ids, out.logprobs) if out.token_ids else None
                if not out.text and not out.finished and logprobs is None:
                    continue  # text held back (a possible stop string, an unfinished character)
                delta = Delta(content=out.text) if out.text else Delta()
                reason = out.finish_reason if out.finished else None
                choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
                yield self.chunk([choice], with_usage=continuous)
        except EngineUnavailable as error:
            yield sse.event(error_body(503, str(error)))
            yield sse.DONE
            return
        if self.body.include_usage:
            yield self.chunk([], with_usage=True)
        yield sse.DONE
