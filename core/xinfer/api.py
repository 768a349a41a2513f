"""The offline Python API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence, Union

from xinfer.config import EngineConfig
from xinfer.engine.engine import LLMEngine, StepOutput
from xinfer.sampling import SamplingParams

Prompt = Union[str, list[int], dict[str, Any]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0

    @property
    def usage(self) -> dict[str, int]:
        completion = sum(len(o.token_ids) for o in self.outputs)
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclass
class _Request:
    output: RequestOutput
    children: dict[str, int] = field(default_factory=dict)  # engine request id -> choice index


class LLM:
    """An engine running in this process.

    ``LLM(model="path", dtype="bfloat16", block_size=16, ...)`` takes any option of
    :class:`xinfer.config.EngineConfig` by name.
    """

    def __init__(self, model: str | None = None, tokenizer: Any = None, **options: Any):
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **options), tokenizer)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Renders each conversation with the model's chat template, then generates."""
        template = self.tokenizer.chat_template if self.tokenizer is not None else None
        if template is None:
            raise ValueError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = template.render(
                conversation, add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs
            )
            # the template writes BOS itself
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, params)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in the order of ``prompts``."""
        requests = self._add(prompts, params)
        for _ in self._run(requests):
            pass
        return [r.output for r in requests]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields, as each step produces them, deltas: a ``RequestOutput`` holding only
        the new tokens and text of one choice of one request."""
        yield from self._run(self._add(prompts, params))

    def _add(self, prompts, params) -> list[_Request]:
        prompts = [prompts] if isinstance(prompts, (str, dict)) or _is_token_list(prompts) else list(prompts)
        params = params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        requests = []
        try:
            for prompt, p in zip(prompts, params):
                requests.append(self._add_one(prompt, p))
        except Exception:
            for request in requests:
                self._abort(request)
            raise
        return requests

    def _add_one(self, prompt: Prompt, params: SamplingParams) -> _Request:
        text, token_ids = self._tokenize(prompt)
        request_id = str(next(self._ids))
        request = _Request(RequestOutput(request_id, text, token_ids, []))
        for index in range(params.n):
            child = replace(params, n=1, seed=None if params.seed is None else params.seed + index)
            child_id = f"{request_id}-{index}" if params.n > 1 else request_id
            try:
                self.engine.add_request(child_id, token_ids, child)
            except Exception:
                self._abort(request)
                raise
            request.children[child_id] = index
            logprobs = [] if child.logprobs is not None else None
            request.output.outputs.append(CompletionOutput(index, "", [], logprobs=logprobs))
        return request

    def _abort(self, request: _Request) -> None:
        for child_id in request.children:
            self.engine.abort(child_id)

    def _run(self, requests: list[_Request]) -> Iterator[RequestOutput]:
        owners = {child: r for r in requests for child in r.children}
        try:
            while self.engine.has_unfinished():
                for delta in self.engine.step():
                    request = owners.get(delta.request_id)
                    if request is not None:
                        yield self._apply(request, delta)
        finally:
            for request in requests:
                if not request.output.finished:
                    self._abort(request)

    def _apply(self, request: _Request, delta: StepOutput) -> RequestOutput:
        index = request.children[delta.request_id]
        choice = request.output.outputs[index]
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        if choice.logprobs is not None:
            choice.logprobs += delta.logprobs
        choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_reason
        output = request.output
        output.num_cached_tokens = max(output.num_cached_tokens, delta.num_cached_tokens)
        output.finished = all(o.finish_reason is not None for o in output.outputs)
        return RequestOutput(
            output.request_id,
            output.prompt,
            output.prompt_token_ids,
            [replace(choice, text=delta.text, token_ids=delta.token_ids, logprobs=delta.logprobs or None)],
            output.finished,
            output.num_cached_tokens,
        )

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)


def _is_token_list(prompts: Any) -> bool:
    return isinstance(prompts, list) and bool(prompts) and all(isinstance(t, int) for t in prompts)
