"""A token's log-probability as outputs carry it: a ``float`` (sums, comparisons and JSON
take it as one) with the fields of vLLM's ``Logprob``, so that code written for either reads it."""

from __future__ import annotations

from torch import Tensor


class Logprob(float):
    """``logprob``; ``rank``: 1 + how many tokens of the vocabulary are more likely (vLLM's:
    ties count as more likely); ``decoded_token``: the token's own text, where the request is
    detokenized (``None`` otherwise)."""

    __slots__ = ("decoded_token", "rank")
    rank: int | None
    decoded_token: str | None

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple[type[Logprob], tuple[float, int | None, str | None]]:
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


def entry(chosen: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float]) -> dict[int, Logprob]:
    """One position's entry: the chosen token with its rank, then the likeliest tokens ranked 1, 2, ... (the
    chosen one, where among them, keeps its place there)."""
    found = {chosen: Logprob(logprob, rank)}
    found.update((t, Logprob(v, r)) for r, (t, v) in enumerate(zip(top_ids, top_values), start=1))
    return found


def chosen_and_ranks(logprobs: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's log-probability of its token in ``tokens`` [R] and that token's rank (vLLM's: 1 + the tokens at
    least as likely, ties ranking above), both [R], on the logprobs' device."""
    chosen = logprobs.gather(1, tokens[:, None])
    return chosen[:, 0], (logprobs >= chosen).sum(1)
