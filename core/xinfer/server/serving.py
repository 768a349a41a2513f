"""What every route shares: the engine, the served model's name, defaults and limits."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from PIL import Image

from xinfer.engine.async_engine import (
    AsyncEngine,
    EngineEntry,
    EngineUnavailable,
    QueueFull,
    RequestHandle,
    TooManySequences,
)
from xinfer.engine.engine import KVCacheFull, LLMEngine
from xinfer.logprob import Logprob
from xinfer.multimodal.inputs import PlaceholderRange
from xinfer.server.disconnect import unless_disconnected
from xinfer.server.errors import APIError, bad_request
from xinfer.server.mcp.config import MCPSettings
from xinfer.server.media import MediaPolicy
from xinfer.server.metrics import Metrics
from xinfer.server.params import SamplingDefaults, request_params, structured_outputs
from xinfer.server.prompts import check_token_ids
from xinfer.server.protocol import GenerationRequest
from xinfer.text.reasoning import PARSERS, ReasoningTags, detect
from xinfer.toolcalls import ToolParser, parser_for
from xinfer.toolcalls import detect as detect_tool_parser

RETRY_AFTER = {"Retry-After": "1"}  # seconds
T = TypeVar("T")


@dataclass
class Serving:
    engine: AsyncEngine
    model_name: str
    model_root: str | None
    defaults: SamplingDefaults
    metrics: Metrics
    aliases: frozenset[str] = frozenset()
    media: MediaPolicy = field(default_factory=MediaPolicy)
    reasoning_parser: str = "auto"  # --reasoning-parser: a name of PARSERS, "auto" or "none"
    disable_reasoning: bool = False  # --disable-reasoning
    mcp: MCPSettings | None = None  # --mcp-command / --mcp-config
    tool_parser: str = "auto"  # --enforce-parser: a name of toolcalls.PARSERS, "auto" or "none"
    started: int = field(default_factory=lambda: int(time.time()))  # the model card's `created`
    _token_texts: dict[int, str] = field(default_factory=dict)
    _token_bytes: dict[int, bytes] = field(default_factory=dict)
    _reasoning: list[ReasoningTags | None] = field(default_factory=list)  # once known

    @property
    def reasoning_tags(self) -> ReasoningTags | None:
        """The reasoning block's tags of the served model, where its reasoning is split
        from its answers (None: not a model that reasons, or reasoning is off)."""
        if self.disable_reasoning or self.reasoning_parser == "none":
            return None
        if not self._reasoning:
            named = PARSERS.get(self.reasoning_parser)
            self._reasoning.append(named or detect(self.tokenizer))
        return self._reasoning[0]

    @property
    def tool_family(self) -> type[ToolParser] | None:
        """The parser of the served model's tool calls (None: answers are read as text only)."""
        if self.tool_parser == "none":
            return None
        if self.tool_parser != "auto":
            return parser_for(self.tool_parser)
        template = getattr(self.tokenizer, "chat_template", None)
        return detect_tool_parser(getattr(template, "source", None))

    @property
    def llm(self) -> LLMEngine:
        if self.engine.engine is None:
            raise unavailable(EngineUnavailable(f"the engine is {self.engine.state.value}"))
        return self.engine.engine

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send token ids")
        return tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.hf_config.vocab_size

    def check_model(self, name: str | None) -> None:
        """A request may name this server's model or an alias, or none (no field, or "", as vLLM takes it)."""
        if name and name != self.model_name and name not in self.aliases:
            message = f"the model {name!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, message, param="model", code="model_not_found")

    def engine_entries(
        self,
        body: GenerationRequest,
        prompts: list[list[int]],
        multimodal: list[PlaceholderRange] | None = None,
        after_token_id: int | None = None,
    ) -> list[EngineEntry]:
        """A request's prompts, each with the sampling of the body's ``n`` choices, as :meth:`submit` queues them,
        the request checked as far as it can be without running the model (a 400 naming the field at fault).
        ``multimodal``: where the images of a one-prompt request go; a constraint (structured outputs) applies
        after ``after_token_id`` where one is given."""
        self.check_sequences(len(prompts), body.n)
        if body.logit_bias and max(map(int, body.logit_bias)) >= self.vocab_size:
            raise bad_request(f"logit_bias token ids must be below the vocabulary's {self.vocab_size}, got "
                              f"{max(map(int, body.logit_bias))}", param="logit_bias")  # fmt: skip
        for name in ("stop_token_ids", "allowed_token_ids"):
            if getattr(body, name):
                check_token_ids(getattr(body, name), self.vocab_size, name)
        constraint = structured_outputs(body, after_token_id)
        entries: list[Any] = [
            (prompt, request_params(body, self.defaults, len(prompt), self.max_model_len, constraint))
            for prompt in prompts
        ]
        if multimodal:
            entries = [(*entries[0], multimodal)]
        return entries

    async def submit(self, request: Request, entries: list[EngineEntry]) -> RequestHandle:
        """Queues what :meth:`engine_entries` made of a request."""
        return await self._ask(request, self.engine.submit(entries))

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """The engine's bound on a request's sequences (:meth:`AsyncEngine.check_sequences`), checked before any
        prompt is encoded, naming the field at fault."""
        try:
            self.engine.check_sequences(num_prompts * n)
        except TooManySequences as error:
            asked = f"{num_prompts} prompts, n={n} each" if num_prompts > 1 else f"n={n}"
            message = (f"the request asks for {error.asked} sequences ({asked}); this server takes at most "
                       f"{error.limit} per request (--max-waiting)")  # fmt: skip
            raise bad_request(message, param="prompt" if num_prompts > 1 else "n") from None

    def check_takes_images(self, urls: list[tuple[str, str]]) -> None:
        """Images (URL, request field) are refused, naming the first, by a model that takes text only."""
        if urls and not self.llm.modalities:
            raise bad_request(f"the model {self.model_name!r} takes text only: it cannot read images",
                              param=urls[0][1])  # fmt: skip

    async def images(self, urls: list[tuple[str, str]]) -> list[Image.Image]:
        """The images of a request (URL, request field), checked against the model and the media policy."""
        self.check_takes_images(urls)
        self.media.check_count("image", len(urls), urls[-1][1])
        return await asyncio.to_thread(lambda: [self.media.load_image(url, param) for url, param in urls])

    async def multimodal_prompt(
        self, token_ids: list[int], images: list[Image.Image], param: str = "messages"
    ) -> tuple[list[int], list[PlaceholderRange]]:
        """``token_ids`` with each image's placeholder expanded (the model's processor, off the event loop);
        ``param``: the field of the prompt, for errors."""
        try:
            return await asyncio.to_thread(self.llm.multimodal_prompt, token_ids, {"image": images})
        except ValueError as error:
            raise bad_request(str(error), param=param) from None

    async def embed(self, request: Request, token_ids: list[list[int]]) -> list[Any]:
        return await self._ask(request, self.engine.embed(token_ids))

    async def prompt_logprobs(
        self, request: Request, prompts: list[list[int]], top_n: int
    ) -> list[list[dict[int, Logprob] | None]]:
        """Each prompt token's log-probability and ``top_n`` alternatives (``None`` for a prompt's first)."""
        return await self._ask(
            request, self.engine.call(lambda engine: [engine.prompt_logprobs(p, top_n) for p in prompts])
        )

    async def _ask(self, request: Request, work: Awaitable[T]) -> T:
        """The engine's answer to ``work``, unless the client leaves first; its errors become 429, 503 or 400."""
        try:
            return await unless_disconnected(request, work)
        except QueueFull as error:
            self.metrics.rejected.labels("queue_full").inc()
            raise APIError(429, str(error), code="queue_full", headers=RETRY_AFTER) from None
        except (EngineUnavailable, KVCacheFull) as error:
            self.metrics.rejected.labels("unavailable").inc()
            raise unavailable(error) from None
        except ValueError as error:
            raise bad_request(str(error)) from None

    def token_text(self, token_id: int) -> str:
        if token_id not in self._token_texts:
            self._token_texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._token_texts[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        if token_id not in self._token_bytes:
            self._token_bytes[token_id] = self.tokenizer.token_bytes(token_id)
        return self._token_bytes[token_id]


def unavailable(error: Exception) -> APIError:
    return APIError(503, str(error), code="unavailable", headers=RETRY_AFTER)
