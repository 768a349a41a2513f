"""What callers see of their requests, and the step loop that produces it.

A request is a prompt and its ``n`` choices, each one engine sequence. The engine's
steps add tokens to sequences; :class:`OutputProcessor` turns them into deltas of
requests: text detokenized with stop strings cut out (a stop string ends its
choice), finish reasons, logprobs and prompt tokens found in the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from xinfer.engine.engine import LLMEngine, StepOutput
from xinfer.engine.failures import log_failure
from xinfer.engine.stop import TextStream
from xinfer.logprob import Logprob
from xinfer.multimodal.inputs import PlaceholderRange
from xinfer.sampling import SamplingParams
from xinfer.text.detokenizer import IncrementalDetokenizer


@dataclass
class CompletionOutput:
    """One choice of a request: all of it so far, or what one step added to it."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # None: not asked for
    error: str | None = None  # why the engine failed this choice (finish reason "error")

    def finished(self) -> bool:  # a method, as vLLM's (RequestOutput.finished is a field, as vLLM's)
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' log-probabilities (vLLM's), where ``logprobs`` were asked for."""
        if self.logprobs is None:
            return None
        return sum(entry[token] for token, entry in zip(self.token_ids, self.logprobs))


@dataclass
class RequestOutput:
    """A request's prompt and choices; a delta holds what one step added to one choice."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # with SamplingParams.prompt_logprobs

    @classmethod
    def empty(cls, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              prompt: str | None = None) -> RequestOutput:  # fmt: skip
        logprobs = params.logprobs is not None
        choices = [CompletionOutput(i, logprobs=[] if logprobs else None) for i in range(params.n)]
        return cls(request_id, prompt, list(prompt_token_ids), choices)

    @property
    def usage(self) -> dict[str, int]:
        completion = sum(len(o.token_ids) for o in self.outputs)
        prompt = len(self.prompt_token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def add(self, delta: RequestOutput) -> None:
        """Appends what ``delta``, a delta of this request, added."""
        for new in delta.outputs:
            choice = self.outputs[new.index]
            choice.text += new.text
            choice.token_ids += new.token_ids
            if choice.logprobs is not None:
                choice.logprobs += new.logprobs or []
            choice.finish_reason, choice.stop_reason, choice.error = new.finish_reason, new.stop_reason, new.error
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        self.finished = all(o.finished() for o in self.outputs)


@dataclass
class _Choice:
    header: RequestOutput  # its request's, without choices: what every delta repeats
    index: int
    text: TextStream


class OutputProcessor:
    """Adds requests to an engine, steps it, and hands out what each step added to them."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._requests: dict[str, list[str]] = {}  # request id -> its choices' sequence ids
        self._choices: dict[str, _Choice] = {}  # by sequence id
        self._token_texts: dict[int, str] = {}  # each token's own text, for its logprobs' decoded_token

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            prompt: str | None = None, multimodal: list[PlaceholderRange] | None = None) -> RequestOutput:  # fmt: skip
        """Adds the request's ``n`` choices to the engine, all or none (choice ``i`` of a
        seeded request uses ``seed + i``); returns the request's output, still empty."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        output = RequestOutput.empty(request_id, prompt_token_ids, params, prompt)
        if params.prompt_logprobs is not None:
            output.prompt_logprobs = self.engine.prompt_logprobs(prompt_token_ids, params.prompt_logprobs, multimodal)
            if self._decodes(params):
                self._decode_tokens(output.prompt_logprobs)
        header = replace(output, outputs=[], prompt_logprobs=None)
        self._requests[request_id] = sequence_ids = []
        try:
            for index in range(params.n):
                sequence_id = f"{request_id}-{index}"
                seed = None if params.seed is None else params.seed + index
                self.engine.add_request(sequence_id, prompt_token_ids, replace(params, n=1, seed=seed), multimodal)
                sequence_ids.append(sequence_id)
                self._choices[sequence_id] = _Choice(header, index, self._text(params, prompt_token_ids))
        except Exception:
            self.abort(request_id)
            raise
        return output

    def abort(self, request_id: str) -> None:
        """Stops what still runs of the request; its choices give no more output."""
        for sequence_id in self._requests.pop(request_id, ()):
            self._choices.pop(sequence_id, None)
            self.engine.abort(sequence_id)  # a no-op for a finished one

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns its deltas, one per choice it added to."""
        return [self._apply(out) for out in self.engine.step() if out.request_id in self._choices]

    def run(self, outputs: list[RequestOutput]) -> Iterator[RequestOutput]:
        """Steps the engine until it is idle, adding to ``outputs`` (from :meth:`add`)
        what each step added to them and yielding it. Leaving early aborts them."""
        by_id = {output.request_id: output for output in outputs}
        try:
            while self.engine.has_unfinished():
                for delta in self.step():
                    if delta.request_id in by_id:
                        by_id[delta.request_id].add(delta)
                        yield delta
        finally:
            for request_id in by_id:
                self.abort(request_id)

    def _apply(self, out: StepOutput) -> RequestOutput:
        choice = self._choices[out.request_id]
        header = choice.header
        finish_reason, stop_reason, error = out.finish_reason, out.stop_reason, out.error
        try:
            text, stop_string = choice.text.push(out.token_ids, out.stop_token)
            if stop_string is not None:
                if not out.finished:
                    self.engine.abort(out.request_id)
                finish_reason, stop_reason = "stop", stop_string
            if finish_reason is not None:
                text += choice.text.finish()
        except Exception as failure:  # noqa: BLE001 - its detokenizing or stop strings: it fails alone
            if not out.finished:
                self.engine.abort(out.request_id)
            text, finish_reason, stop_reason, error = "", "error", None, log_failure(out.request_id, failure)
        if finish_reason is not None:
            del self._choices[out.request_id]
        finished = not any(s in self._choices for s in self._requests[header.request_id])
        if finished:
            del self._requests[header.request_id]
        header.num_cached_tokens = max(header.num_cached_tokens, out.num_cached_tokens)
        if out.logprobs and choice.text.detokenizer is not None:
            self._decode_tokens(out.logprobs)
        delta = CompletionOutput(choice.index, text, out.token_ids, finish_reason, stop_reason, out.logprobs or None,
                                 error)  # fmt: skip
        # not dataclasses.replace: this runs for every sequence every step, and replace costs ~5 µs
        return RequestOutput(header.request_id, header.prompt, header.prompt_token_ids, [delta], finished,
                             header.num_cached_tokens)  # fmt: skip

    def _decodes(self, params: SamplingParams) -> bool:
        return self.engine.tokenizer is not None and params.detokenize

    def _decode_tokens(self, entries: Sequence[dict[int, Logprob] | None]) -> None:
        """Sets each logprob's ``decoded_token``: its token alone decoded, special tokens kept (vLLM's)."""
        tokenizer, texts = self.engine.tokenizer, self._token_texts
        assert tokenizer is not None
        for entry in entries:
            for token, logprob in (entry or {}).items():
                if token not in texts:
                    texts[token] = tokenizer.decode([token], skip_special_tokens=False)
                logprob.decoded_token = texts[token]

    def _text(self, params: SamplingParams, prompt_token_ids: list[int]) -> TextStream:
        tokenizer, skip = self.engine.tokenizer, params.skip_special_tokens
        detokenizer = IncrementalDetokenizer(tokenizer, skip, prompt_token_ids) if self._decodes(params) else None
        return TextStream(detokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens)
