"""``POST /v1/chat/completions``."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xinfer.engine.output import CompletionOutput
from xinfer.server.body import parse_body
from xinfer.server.logprobs import chat_logprobs
from xinfer.server.prompts import check_token_ids, message_dicts, render_chat
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

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, ChatCompletionRequest)
    serving.check_model(body.model)
    _, urls = message_dicts(body.messages)
    images = await serving.images(urls) if urls else []
    text = render_chat(
        serving.tokenizer,
        body.messages,
        body.add_generation_prompt,
        body.continue_final_message,
        body.tools,
        body.chat_template_kwargs,
    )
    prompt = serving.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
    check_token_ids(prompt, serving.vocab_size, "messages")
    prompt, multimodal = await serving.multimodal_prompt(prompt, images) if images else (prompt, [])
    handle = await serving.submit(request, body, [prompt], multimodal)
    return await ChatAnswer(serving, body, handle).respond(request)


class ChatAnswer(Answer):
    id_prefix, whole_type, chunk_type = "chatcmpl", ChatCompletion, ChatCompletionChunk
    body: ChatCompletionRequest

    def logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> ChatLogprobs | None:
        if not self.body.logprobs or entries is None:
            return None
        n = self.body.top_logprobs or 0
        return ChatLogprobs(content=chat_logprobs(token_ids, entries, n, self.serving.token_text))

    def choice(self, index: int, output: CompletionOutput) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=AssistantMessage(content=output.text),
            logprobs=self.logprobs(output.token_ids, output.logprobs),
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
        )

    async def events(self) -> AsyncIterator[str]:
        continuous = self.body.stream_options is not None and self.body.stream_options.continuous_usage_stats
        for index in range(self.body.n):
            yield self.chunk([ChatChunkChoice(index=index, delta=Delta(role="assistant", content=""))])
        async for index, out in self.serving.engine.stream(self.handle):
            logprobs = self.logprobs(out.token_ids, out.logprobs) if out.token_ids else None
            if not out.text and not out.finished and logprobs is None:
                continue  # text held back (a possible stop string, an unfinished character)
            delta = Delta(content=out.text) if out.text else Delta()
            reason = out.finish_reason if out.finished else None
            choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=reason)
            yield self.chunk([choice], with_usage=continuous)
