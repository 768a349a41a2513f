"""Sampling parameters of a request: the body's values over the server's defaults."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from xinfer.grammar import StructuredOutputs
from xinfer.sampling import SamplingParams
from xinfer.server.errors import bad_request
from xinfer.server.protocol import ChatCompletionRequest, GenerationRequest
from xinfer.server.tools import forced_schema

# what a request may leave out, the server's default (or SamplingParams') then applying
OPTIONAL_FIELDS = ("temperature", "top_k", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                   "repetition_penalty", "seed")  # fmt: skip


@dataclass(frozen=True)
class SamplingDefaults:
    """Set by ``--temperature``, ``--top-k``, ... or the model's generation config, and used where a request says
    nothing."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # --max-tokens: over a route's own default (OpenAI's 16 on /v1/completions)
    recommended_max_tokens: int | None = None  # generation_config.json's max_new_tokens: under a route's default, a cap

    def sampling(self) -> dict[str, Any]:
        """The defaults as :class:`SamplingParams` fields but the token limit (:meth:`token_limit`, the route's)."""
        fields = asdict(self)
        del fields["max_tokens"], fields["recommended_max_tokens"]
        return fields

    def token_limit(self, requested: int | None, route_default: int | None, room: int) -> int:
        """The token limit of a request asking for ``requested`` (None: the defaults'), within ``room`` and, as
        vLLM caps it, the generation config's ``max_new_tokens``."""
        wanted = requested or self.max_tokens or route_default or self.recommended_max_tokens or room
        return min(wanted, self.recommended_max_tokens or room, room)


def structured_outputs(body: GenerationRequest, after_token_id: int | None = None) -> StructuredOutputs | None:
    """The request's constraint (``response_format``, ``structured_outputs``, or the calls a
    chat request's ``tool_choice`` forces), checked:
    a bad schema, regex or grammar is a 400 naming it. ``after_token_id``: it applies
    after reasoning, which that token ends."""
    requested = format_constraint(body, after_token_id)
    if not isinstance(body, ChatCompletionRequest):
        return requested
    schema = forced_schema(body.tools, body.tool_choice, body.parallel_tool_calls)
    if schema is None:
        return requested
    if body.structured_outputs is not None:
        raise bad_request("a tool_choice that forces a call cannot be combined with structured_outputs",
                          param="structured_outputs")  # fmt: skip
    # the forced call is the whole answer: response_format governs a message's text, which it has none of
    try:
        return StructuredOutputs(json=schema, strict=False, after_token_id=after_token_id)
    except ValueError as error:
        raise bad_request(str(error), param="tools", code="invalid_structured_output") from None


def format_constraint(body: GenerationRequest, after_token_id: int | None) -> StructuredOutputs | None:
    """The constraint ``response_format`` or ``structured_outputs`` asks for, checked."""
    fmt, given = body.response_format, body.structured_outputs
    param = body.format_name if fmt is not None and fmt.type != "text" else "structured_outputs"
    try:
        if fmt is not None and fmt.type == "json_object":
            return StructuredOutputs(json_object=True, after_token_id=after_token_id)
        if fmt is not None and fmt.type == "json_schema":
            assert fmt.json_schema is not None and fmt.json_schema.json_schema is not None
            schema, strict = fmt.json_schema.json_schema, bool(fmt.json_schema.strict)
            return StructuredOutputs(json=schema, strict=strict, after_token_id=after_token_id)
        if given is not None:
            return StructuredOutputs(
                json=given.json_schema,
                json_object=bool(given.json_object),
                regex=given.regex,
                choice=given.choice,
                grammar=given.grammar,
                after_token_id=after_token_id,
            )
    except ValueError as error:
        raise bad_request(str(error), param=param, code="invalid_structured_output") from None
    return None


def request_params(
    body: GenerationRequest,
    defaults: SamplingDefaults,
    num_prompt_tokens: int,
    max_model_len: int,
    constraint: StructuredOutputs | None = None,
) -> SamplingParams:
    """The ``SamplingParams`` of a request for one prompt, its ``n`` choices included."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens, the model's context is {max_model_len} tokens: "
            f"shorten the prompt to leave room for at least one generated token",
            param=body.prompt_name,
            code="context_length_exceeded",
        )
    token_limit = body.token_limit
    if token_limit is not None and token_limit > room:
        raise bad_request(
            f"the model's context is {max_model_len} tokens; the prompt has {num_prompt_tokens} and "
            f"{token_limit} more were asked for ({num_prompt_tokens + token_limit} in all): "
            f"lower {body.token_limit_name} to at most {room}",
            param=body.token_limit_name,
            code="context_length_exceeded",
        )
    given = {name: getattr(body, name) for name in OPTIONAL_FIELDS if getattr(body, name) is not None}
    max_tokens = defaults.token_limit(token_limit, body.default_max_tokens, room)
    if body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) must not exceed the token limit ({max_tokens})",
                          param="min_tokens")  # fmt: skip
    try:
        return SamplingParams(
            **(defaults.sampling() | given | {"max_tokens": max_tokens}),
            n=body.n,
            min_tokens=body.min_tokens,
            stop=body.stop_strings,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            include_stop_str_in_output=body.include_stop_str_in_output,
            logprobs=body.num_logprobs,
            prompt_logprobs=body.prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=constraint,
            logit_bias={int(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
        )
    except ValueError as error:
        raise bad_request(str(error)) from None
