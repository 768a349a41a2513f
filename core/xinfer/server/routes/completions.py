"""``POST /v1/completions``: one prompt or many, as text or token ids.

Choice ``i * n + j`` is sample ``j`` of prompt ``i``, as in OpenAI's API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from xinfer.engine.async_engine import EngineUnavailable, RequestHandle
from xinfer.server import sse
from xinfer.server.body import parse_body
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import error_body
from xinfer.server.logprobs import extend_completion_logprobs
from xinfer.server.params import request_params
from xinfer.server.prompts import check_token_ids, encode_prompts
from xinfer.server.protocol import CompletionRequest
from xinfer.server.responses import Completion, CompletionChoice, CompletionLogprobs, Usage, new_id, usage
from xinfer.server.serving import Serving
from xinfer.server.streaming import EngineStreamResponse

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, CompletionRequest)
    serving.check_model(body.model)
    prompts = encode_prompts(lambda: serving.tokenizer, body.prompt, body.add_special_tokens)
    requests = []
    for i, prompt in enumerate(prompts):
        check_token_ids(prompt, serving.vocab_size, "prompt" if len(prompts) == 1 else f"prompt.{i}")
        params = request_params(
            body, serving.defaults, len(prompt), serving.max_model_len, body.token_limit, body.num_logprobs
        )
        requests.append((prompt, params))
    handle = await serving.submit(request, requests)
    run = CompletionRun(serving, body, handle)
    if body.stream:
        return EngineStreamResponse(run.events(), serving.engine, handle)
    try:
        return JSONResponse((await run.collect(request)).model_dump())
    finally:
        serving.engine.release(handle)


class CompletionRun:
    def __init__(self, serving: Serving, body: CompletionRequest, handle: RequestHandle):
        self.serving = serving
        self.body = body
        self.handle = handle
        self.id = new_id("cmpl")
        num_choices = len(handle.choices)
        self.offsets = [0] * num_choices
        self.logprobs = [CompletionLogprobs() if body.logprobs is not None else None for _ in range(num_choices)]

    def echo(self, index: int) -> str:
        """The prompt's text, for ``echo``; its tokens enter the logprobs without values."""
        if not self.body.echo:
            return ""
        prompt = self.handle.outputs[index // self.body.n].prompt_token_ids
        self.add_logprobs(index, prompt, [None] * len(prompt))
        return self.serving.tokenizer.decode(prompt, skip_special_tokens=False)

    def add_logprobs(self, index: int, token_ids: list[int], entries: list | None) -> None:
        result = self.logprobs[index]
        if result is not None and entries is not None:
            self.offsets[index] = extend_completion_logprobs(
                result, token_ids, entries, self.body.logprobs or 0, self.serving.token_text, self.offsets[index]
            )

    def usage(self) -> Usage:
        handle = self.handle
        return usage(handle.num_prompt_tokens, handle.num_generated, handle.num_cached_tokens)

    async def collect(self, request: Request) -> Completion:
        done = await unless_disconnected(request, self.serving.engine.collect(self.handle))
        choices = []
        for i, choice in enumerate(done):
            text = self.echo(i) + choice.text  # the echo's logprobs first
            self.add_logprobs(i, choice.token_ids, choice.logprobs)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=text,
                    logprobs=self.logprobs[i],
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        return Completion(id=self.id, model=self.serving.model_name, choices=choices, usage=self.usage())

    def chunk(self, index: int, text: str, finish_reason: str | None = None) -> str:
        logprobs = self.logprobs[index]
        if logprobs is not None:
            self.logprobs[index] = CompletionLogprobs()  # each chunk carries only its own tokens
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return sse.event(Completion(id=self.id, model=self.serving.model_name, choices=[choice]))

    async def events(self) -> AsyncIterator[str]:
        if self.body.echo:
            for index in range(len(self.offsets)):
                yield self.chunk(index, self.echo(index))
        try:
            async for index, out in self.serving.engine.stream(self.handle):
                self.add_logprobs(index, out.token_ids, out.logprobs)
                if out.text or out.finished or self.logprobs[index] is not None:
                    yield self.chunk(index, out.text, out.finish_reason if out.finished else None)
        except EngineUnavailable as error:
            yield sse.event(error_body(503, str(error)))
            yield sse.DONE
            return
        if self.body.include_usage:
            yield sse.event(Completion(id=self.id, model=self.serving.model_name, choices=[], usage=self.usage()))
        yield sse.DONE
