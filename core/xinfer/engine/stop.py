"""Text of a sequence as it grows, with stop strings cut out before they reach a client."""

from __future__ import annotations

from xinfer.text.detokenizer import IncrementalDetokenizer


class TextStream:
    """Holds back the tail that could still become a stop string."""

    def __init__(self, detokenizer: IncrementalDetokenizer | None, stop: list[str], include_stop: bool = False):
        self.detokenizer = detokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def push(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Adds tokens; returns the new text safe to emit and the stop string hit, if any."""
        if self.detokenizer is None:
            return "", None
        new = "".join([self.detokenizer.push(token) for token in token_ids])
        if not self.stop:  # nothing held back, nothing kept: the text of a long answer is not copied each token
            return new, None
        previous = len(self.text)
        self.text += new
        search_from = max(0, previous - self.hold)
        hits = [(i, stop) for stop in self.stop if (i := self.text.find(stop, search_from)) != -1]
        if hits:
            index, stop = min(hits)
            end = index + len(stop) if self.include_stop else index
            self.text, self.stopped = self.text[:end], True
            return self._take(end), stop
        return self._take(len(self.text) - self.hold), None

    def finish(self) -> str:
        """The rest of the text, once the sequence ends."""
        if self.detokenizer is not None and not self.stopped:
            self.text += self.detokenizer.flush()
        return self._take(len(self.text))  # without stop strings, text holds only the flush

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
