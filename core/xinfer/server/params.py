"""Sampling parameters of a request: the body's values over the server's defaults."""

from __future__ import annotations

from dataclasses import dataclass

from xinfer.sampling import SamplingParams
from xinfer.server.errors import bad_request
from xinfer.server.protocol import SamplingFields


@dataclass(frozen=True)
class SamplingDefaults:
    """Set by ``--temperature``, ``--top-k``, ... and used where a request says nothing."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None


def request_params(
    body: SamplingFields,
    defaults: SamplingDefaults,
    num_prompt_tokens: int,
    max_model_len: int,
    token_limit: int | None,
    num_logprobs: int | None,
) -> SamplingParams:
    """The ``SamplingParams`` of a request for one prompt, its ``n`` choices included."""
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise bad_request(
            f"the prompt has {num_prompt_tokens} tokens, the model's context is {max_model_len} tokens: "
            f"shorten the prompt to leave room for at least one generated token",
            param="messages" if hasattr(body, "messages") else "prompt",
            code="context_length_exceeded",
        )
    if token_limit is not None and token_limit > room:
        raise bad_request(
            f"the model's context is {max_model_len} tokens; the prompt has {num_prompt_tokens} and "
            f"{token_limit} more were asked for ({num_prompt_tokens + token_limit} in all): "
            f"lower max_tokens to at most {room}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    max_tokens = token_limit or min(defaults.max_tokens or room, room)
    try:
        return SamplingParams(
            n=body.n,
            temperature=_pick(body.temperature, defaults.temperature),
            top_k=_pick(body.top_k, defaults.top_k),
            top_p=_pick(body.top_p, defaults.top_p),
            min_p=_pick(body.min_p, 0.0),
            frequency_penalty=_pick(body.frequency_penalty, defaults.frequency_penalty),
            presence_penalty=_pick(body.presence_penalty, defaults.presence_penalty),
            repetition_penalty=_pick(body.repetition_penalty, 1.0),
            seed=_pick(body.seed, defaults.seed),
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop_strings,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=num_logprobs,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as error:
        raise bad_request(str(error)) from None


def _pick(value, default):
    return default if value is None else value
