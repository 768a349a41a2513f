"""``POST /v1/chat/completions``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xinfer.engine.async_engine import RequestHandle
from xinfer.engine.output import CompletionOutput
from xinfer.server.body import parse_body
from xinfer.server.chat_run import submit_chat
from xinfer.server.logprobs import chat_logprobs
from xinfer.server.protocol import ChatCompletionRequest
from xinfer.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    Delta,
)
from xinfer.server.serving import Serving
from xinfer.server.streaming import Answer
from xinfer.text.reasoning import ReasoningStream, ReasoningTags, reasoning_token_count, split

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, ChatCompletionRequest)
    serving.check_model(body.model)
    handle, prompt = await submit_chat(request, serving, body)
    return await ChatAnswer(serving, body, handle, prompt.tags, prompt.inside).respond(request)


class ChatAnswer(Answer):
    id_prefix, whole_type, chunk_type = "chatcmpl", ChatCompletion, ChatCompletionChunk
    body: ChatCompletionRequest

    def __init__(
        self,
        serving: Serving,
        body: ChatCompletionRequest,
        handle: RequestHandle,
        tags: ReasoningTags | None = None,
        inside: bool = False,
    ):
        super().__init__(serving, body, handle)
        self.tags, self.inside = tags, inside

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> ChatLogprobs | None:
        if not self.body.logprobs or entries is None:
            return None
        n = self.body.top_logprobs or 0
        return ChatLogprobs(content=chat_logprobs(token_ids, entries, n, self.serving.token_text))

    def choice(self, index: int, output: CompletionOutput) -> ChatChoice:
        reasoning, content = split(output.text, self.tags, self.inside) if self.tags else (None, output.text)
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=content, reasoning_content=reasoning),
            logprobs=self.logprobs(output.token_ids, output.logprobs),
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )

    def reasoning_tokens(self) -> int | None:
        if self.tags is None:
            return None
        tokenizer = self.serving.tokenizer
        start, end = tokenizer.token_to_id(self.tags.start), tokenizer.token_to_id(self.tags.end)
        return sum(reasoning_token_count(c.token_ids, start, end, self.inside) for c in self.handle.choices)

    async def events(self) -> AsyncIterator[str]:
        continuous = self.body.stream_options is not None and self.body.stream_options.continuous_usage_stats
        splits = [ReasoningStream(self.tags, self.inside) if self.tags else None for _ in range(self.body.n)]
        for index in range(self.body.n):
            yield self.chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        async for index, out in self.serving.engine.stream(self.handle):
            logprobs = self.logprobs(out.token_ids, out.logprobs) if out.token_ids else None
            reasoning, content = "", out.text
            stream = splits[index]
            if stream is not None:
                reasoning, content = stream.push(out.text)
                if out.finished:
                    more_reasoning, more_content = stream.finish()
                    reasoning, content = reasoning + more_reasoning, content + more_content
            if not reasoning and not content and not out.finished and logprobs is None:
                continue  # text held back (a possible stop string or tag, an unfinished character)
            delta = Delta(content=content or None, reasoning_content=reasoning or None)
            reason = out.finish_reason if out.finished else None
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
            yield self.chunk([choice], with_usage=continuous)
