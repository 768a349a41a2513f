"""Token log-probabilities in the two shapes OpenAI uses (chat and legacy completions).

The engine gives, per generated token, a dict holding the chosen token's logprob
and the top-N alternatives.
"""

from __future__ import annotations

from collections.abc import Callable

from xinfer.server.responses import CompletionLogprobs, TokenLogprob, TopLogprob

TokenText = Callable[[int], str]


def top_n(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:n]


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], n: int, text: TokenText) -> list[TokenLogprob]:
    def top(token_id: int, logprob: float) -> TopLogprob:
        piece = text(token_id)
        return TopLogprob(token=piece, logprob=logprob, bytes=list(piece.encode()))

    return [
        TokenLogprob(**top(token, entry[token]).model_dump(), top_logprobs=[top(t, lp) for t, lp in top_n(entry, n)])
        for token, entry in zip(token_ids, entries)
    ]


def extend_completion_logprobs(
    result: CompletionLogprobs,
    token_ids: list[int],
    entries: list[dict[int, float] | None],
    n: int,
    text: TokenText,
    offset: int,
) -> int:
    """Appends tokens (``None`` entries for echoed prompt tokens); returns the next text offset."""
    for token, entry in zip(token_ids, entries):
        piece = text(token)
        result.tokens.append(piece)
        result.token_logprobs.append(None if entry is None else entry[token])
        result.top_logprobs.append(None if entry is None else {text(t): lp for t, lp in top_n(entry, n)})
        result.text_offset.append(offset)
        offset += len(piece)
    return offset
