"""Text of a sequence as it grows, with stop strings cut out before they reach a client."""

from __future__ import annotations

from typing import Protocol


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...


class TextStream:
    """Holds back the tail that could still become a stop string."""

    def __init__(self, detokenizer: Detokenizer | None, stop: list[str]):
        self.detokenizer = detokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0

    def push(self, token_id: int) -> tuple[str, str | None]:
        """Adds a token; returns the new text safe to emit and the stop string hit, if any."""
        if self.detokenizer is None:
            return "", None
        previous = len(self.text)
        self.text += self.detokenizer.push(token_id)
        search_from = max(0, previous - self.hold)
        hits = [(i, stop) for stop in self.stop if (i := self.text.find(stop, search_from)) != -1]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            return self.flush(), stop
        return self._take(len(self.text) - self.hold), None

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
