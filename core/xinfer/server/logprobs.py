"""Token log-probabilities in the two shapes OpenAI uses (chat and legacy completions).

The engine gives, per generated token, a dict holding the chosen token's logprob
and the top-N alternatives.
"""

from __future__ import annotations

from collections.abc import Callable

from xinfer.logprob import Logprob
from xinfer.server.responses import CompletionLogprobs, PromptLogprob, PromptLogprobs, TokenLogprob, TopLogprob

TokenText = Callable[[int], str]
TokenBytes = Callable[[int], bytes]


def top_n(entry: dict[int, Logprob], n: int) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:n]


def token_id_name(token_id: int) -> str:
    """A token as vLLM's ``return_tokens_as_token_ids`` names it in logprobs."""
    return f"token_id:{token_id}"


def token_id_name_bytes(token_id: int) -> bytes:
    return token_id_name(token_id).encode()


def token_names(text: TokenText, as_token_ids: bool) -> TokenText:
    """How logprobs name tokens: by their ``text``, or as "token_id:<id>" (``return_tokens_as_token_ids``)."""
    return token_id_name if as_token_ids else text


def chat_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob]],
    n: int,
    text: TokenText,
    raw: TokenBytes,
    as_token_ids: bool = False,
) -> list[TokenLogprob]:
    """Each token's text, bytes (those of a part of a character too: joined, they are the answer's) and logprob.
    ``as_token_ids``: tokens named "token_id:<id>"; the chosen token keeps its own bytes, an alternative's are those
    of its name, as vLLM's."""
    name = token_names(text, as_token_ids)
    alternative_bytes = token_id_name_bytes if as_token_ids else raw

    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=name(token_id), logprob=logprob, bytes=list(alternative_bytes(token_id)))

    return [
        TokenLogprob(token=name(token), logprob=entry[token], bytes=list(raw(token)),
                     top_logprobs=[top(t, lp) for t, lp in top_n(entry, n)])
        for token, entry in zip(token_ids, entries)
    ]  # fmt: skip


def extend_completion_logprobs(
    result: CompletionLogprobs,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    n: int,
    text: TokenText,
    offset: int,
    as_token_ids: bool = False,
) -> int:
    """Appends tokens (``None`` entries for echoed prompt tokens); returns the next text offset.
    Each token's top alternatives include the token itself, as OpenAI's do (``n`` + 1 of them at most).
    ``as_token_ids``: tokens named "token_id:<id>", the offsets adding up those names' lengths, as vLLM's."""
    name = token_names(text, as_token_ids)
    for token, entry in zip(token_ids, entries):
        piece = name(token)
        result.tokens.append(piece)
        result.token_logprobs.append(None if entry is None else entry[token])
        if entry is None:
            result.top_logprobs.append(None)
        else:
            top: dict[str, float] = {name(t): lp for t, lp in top_n(entry, n)}
            top.setdefault(piece, entry[token])
            result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(piece)
    return offset


def prompt_logprobs(entries: list[dict[int, Logprob] | None], text: TokenText) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt token, its own score and the likeliest tokens' there, ranked."""
    return [
        None if entry is None
        else {str(t): PromptLogprob(logprob=lp, rank=lp.rank, decoded_token=text(t)) for t, lp in entry.items()}
        for entry in entries
    ]  # fmt: skip
