"""``POST /v1/completions``: one prompt or many, as text or token ids.

Choice ``i * n + j`` is sample ``j`` of prompt ``i``, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from xinfer.engine.async_engine import RequestHandle
from xinfer.engine.output import CompletionOutput
from xinfer.logprob import Logprob
from xinfer.server.body import parse_body
from xinfer.server.errors import bad_request
from xinfer.server.logprobs import extend_completion_logprobs, prompt_logprobs
from xinfer.server.prompts import encode_prompts
from xinfer.server.protocol import CompletionRequest, prompt_list
from xinfer.server.responses import Completion, CompletionChoice, CompletionLogprobs, PromptLogprobs, new_id, usage
from xinfer.server.serving import Serving
from xinfer.server.streaming import SSE_DONE, SSE_HEADERS, Answer, sse_event

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    body = await parse_body(request, CompletionRequest)
    serving.check_model(body.model)
    serving.check_sequences(body.num_prompts, body.n)  # before any prompt is encoded or scored
    prompts = await asyncio.to_thread(  # (seconds for megabytes: off the event loop)
        encode_prompts, lambda: serving.tokenizer, body.prompt, serving.vocab_size, "prompt", body.add_special_tokens
    )
    cut = [body.truncated(prompt, serving.max_model_len) for prompt in prompts]
    # echo gives each prompt back as sent (vLLM's prompt text); token ids, and a prompt cut, decoded
    texts = [sent if isinstance(sent, str) and len(c) == len(p) else None
             for sent, p, c in zip(prompt_list(body.prompt), prompts, cut)]  # fmt: skip
    prompts = cut
    if body.max_tokens == 0:
        check_context(serving, prompts)
        echoed = await echo_logprobs(serving, request, body, prompts)
        scored = echoed  # vLLM's prompt_logprobs: those asked for, else echo's
        if body.prompt_logprobs is not None:
            scored = await serving.prompt_logprobs(request, prompts, body.prompt_logprobs)
        return echo_only(serving, body, prompts, texts, echoed, scored)
    entries = serving.engine_entries(body, prompts)  # checked before the prompts are scored
    echoed = await echo_logprobs(serving, request, body, prompts)
    handle = await serving.submit(request, entries)
    return await CompletionAnswer(serving, body, handle, texts, echoed).respond(request)


async def echo_logprobs(
    serving: Serving, request: Request, body: CompletionRequest, prompts: list[list[int]]
) -> list[list[dict[int, Logprob] | None]] | None:
    """The prompts' logprobs, where they are echoed with logprobs."""
    if not body.echo or body.logprobs is None:
        return None
    return await serving.prompt_logprobs(request, prompts, body.logprobs)


def check_context(serving: Serving, prompts: list[list[int]]) -> None:
    """Prompts given back alone may fill the context."""
    for prompt in prompts:
        if len(prompt) > serving.max_model_len:
            message = f"the prompt has {len(prompt)} tokens, the model's context is {serving.max_model_len} tokens"
            raise bad_request(message, param="prompt", code="context_length_exceeded")


def echo_only(
    serving: Serving,
    body: CompletionRequest,
    prompts: list[list[int]],
    texts: list[str | None],
    echoed: list[list[dict[int, Logprob] | None]] | None,
    scored: list[list[dict[int, Logprob] | None]] | None = None,
) -> Response:
    """The answer to ``echo`` with ``max_tokens`` 0: each prompt given back (with its logprobs where
    asked), nothing generated."""
    choices = []
    for i, prompt in enumerate(prompts):
        text = echo_text(serving, prompt, texts[i])
        for j in range(body.n):
            logprobs = None
            if echoed is not None:
                logprobs = CompletionLogprobs()
                extend_completion_logprobs(logprobs, prompt, echoed[i], body.logprobs or 0, serving.token_text, 0,
                                           body.return_tokens_as_token_ids)  # fmt: skip
            scores = None
            if scored is not None:
                scores = prompt_logprobs(scored[i], serving.token_text)
            choices.append(CompletionChoice(index=i * body.n + j, text=text, logprobs=logprobs, finish_reason="length",
                                            prompt_logprobs=scores, prompt_token_ids=body.returned_ids(prompt),
                                            token_ids=body.returned_ids([])))  # fmt: skip
    # the prompts are not run, or (scored) computed whole: none of their tokens is read from the prefix cache
    answer = Completion(id=new_id("cmpl"), model=serving.model_name, choices=choices,
                        usage=usage(sum(map(len, prompts)), 0, cached_tokens=0))  # fmt: skip
    if not body.stream:
        return JSONResponse(answer.model_dump())
    chunks = [answer.model_copy(update={"choices": [choice], "usage": None}) for choice in choices]
    if body.include_usage:
        chunks.append(answer.model_copy(update={"choices": []}))
    events = [*map(sse_event, chunks), SSE_DONE]
    return StreamingResponse(iter(events), media_type="text/event-stream", headers=SSE_HEADERS)


def echo_text(serving: Serving, prompt: list[int], text: str | None) -> str:
    """The text ``echo`` gives back: the prompt as sent, else its tokens decoded (special tokens included)."""
    return text if text is not None else serving.tokenizer.decode(prompt, skip_special_tokens=False)


class CompletionAnswer(Answer):
    id_prefix, whole_type, chunk_type = "cmpl", Completion, Completion
    body: CompletionRequest

    def __init__(
        self,
        serving: Serving,
        body: CompletionRequest,
        handle: RequestHandle,
        texts: list[str | None],
        echoed: list[list[dict[int, Logprob] | None]] | None = None,
    ):
        super().__init__(serving, body, handle)
        self.texts = texts  # the prompts as sent (None: as token ids)
        self.echoed = echoed
        num_choices = len(handle.choices)
        self.offsets = [0] * num_choices
        self.logprobs = [CompletionLogprobs() if body.logprobs is not None else None for _ in range(num_choices)]
        self.started: set[int] = set()  # the choices streamed a chunk of

    def prompt_token_ids(self, index: int) -> list[int]:
        return self.handle.outputs[index // self.body.n].prompt_token_ids

    def echo(self, index: int) -> str:
        """The prompt's text, for ``echo``; its tokens enter the logprobs first."""
        if not self.body.echo:
            return ""
        i = index // self.body.n
        prompt = self.prompt_token_ids(index)
        self.add_logprobs(index, prompt, self.echoed[i] if self.echoed else None)
        return echo_text(self.serving, prompt, self.texts[i])

    def add_logprobs(self, index: int, token_ids: list[int], entries: list | None) -> None:
        result, body = self.logprobs[index], self.body
        if result is not None and entries is not None:
            self.offsets[index] = extend_completion_logprobs(result, token_ids, entries, body.logprobs or 0,
                                                             self.serving.token_text, self.offsets[index],
                                                             body.return_tokens_as_token_ids)  # fmt: skip

    def prompt_logprobs(self, position: int) -> PromptLogprobs | None:
        """vLLM's: those asked for, else, where the prompt is echoed with logprobs, those."""
        if self.body.prompt_logprobs is None and self.echoed is not None:
            return prompt_logprobs(self.echoed[position], self.serving.token_text)
        return super().prompt_logprobs(position)

    def choice(self, index: int, output: CompletionOutput) -> CompletionChoice:
        text = self.echo(index) + output.text  # the echo's logprobs first
        self.add_logprobs(index, output.token_ids, output.logprobs)
        return CompletionChoice(
            index=index,
            text=text,
            logprobs=self.logprobs[index],
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            prompt_logprobs=self.prompt_logprobs(index // self.body.n),
            prompt_token_ids=self.body.returned_ids(self.prompt_token_ids(index)),
            token_ids=self.body.returned_ids(output.token_ids),
        )

    def text_chunk(self, index: int, text: str, step: CompletionOutput) -> str:
        """A chunk of choice ``index``: ``text`` and what ``step`` added to the choice (the echo: an empty step)."""
        logprobs = self.logprobs[index]
        if logprobs is not None:
            self.logprobs[index] = CompletionLogprobs()  # each chunk carries only its own tokens
        first = index not in self.started
        self.started.add(index)
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=step.finish_reason,
            stop_reason=step.stop_reason,
            prompt_token_ids=self.body.returned_ids(self.prompt_token_ids(index)) if first else None,
            token_ids=self.body.returned_ids(step.token_ids),
        )
        return self.chunk(choice)

    async def events(self) -> AsyncIterator[str]:
        if self.body.echo:
            for index in range(len(self.offsets)):
                yield self.text_chunk(index, self.echo(index), CompletionOutput(index % self.body.n))
        async for index, out in self.serving.engine.stream(self.handle):
            self.add_logprobs(index, out.token_ids, out.logprobs)
            returns_ids = self.body.return_token_ids and out.token_ids
            if out.text or out.finished() or self.logprobs[index] is not None or returns_ids:
                yield self.text_chunk(index, out.text, out)
