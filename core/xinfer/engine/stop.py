"""Text of a sequence as it grows, with stop strings cut out before they reach a client."""

from __future__ import annotations

from xinfer.text.detokenizer import IncrementalDetokenizer


class TextStream:
    """Holds back the tail that could still become a stop string. As in vLLM, a stop string
    counts only where it ends in the text of a token after the first ``min_tokens``."""

    def __init__(
        self, detokenizer: IncrementalDetokenizer | None, stop: list[str], include_stop: bool = False,
        min_tokens: int = 0,
    ):  # fmt: skip
        self.detokenizer = detokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self.num_tokens = 0
        self.min_text = 0  # the length of the first min_tokens tokens' text, once they are all in

    def push(self, token_ids: list[int], stop_token: bool = False) -> tuple[str, str | None]:
        """Adds tokens; returns the new text safe to emit and the stop string hit, if any.
        ``stop_token``: the last one ended the sequence (a stop token id or EOS); as in vLLM, its
        text is left out but for ``include_stop``."""
        if self.detokenizer is None:
            return "", None
        if stop_token and not self.include_stop:
            token_ids = token_ids[:-1]
        if not self.stop:  # nothing held back, nothing kept: the text of a long answer is not copied each token
            return "".join([self.detokenizer.push(token) for token in token_ids]), None
        previous = len(self.text)
        for token in token_ids:
            self.text += self.detokenizer.push(token)
            self.num_tokens += 1
            if self.num_tokens == self.min_tokens:
                self.min_text = len(self.text)
        if self.num_tokens <= self.min_tokens:
            return self._take(len(self.text) - self.hold), None
        # as vLLM's check_stop_strings: the first listed of those the new text completes (a "\n\n" token completes
        # both stop=["\n\n", "\n"]: "\n\n" is the stop string)
        for stop in self.stop:
            if (index := self._find(stop, previous)) != -1:
                end = index + len(stop) if self.include_stop else index
                self.text, self.stopped = self.text[:end], True
                return self._take(end), stop
        return self._take(len(self.text) - self.hold), None

    def _find(self, stop: str, previous: int) -> int:
        """Where ``stop`` first occurs ending in the text added since ``previous`` and after the first
        ``min_tokens`` tokens' text; -1 where it does not."""
        return self.text.find(stop, max(0, previous - self.hold, self.min_text - len(stop) + 1))

    def finish(self) -> str:
        """The rest of the text, once the sequence ends."""
        if self.detokenizer is not None and not self.stopped:
            self.text += self.detokenizer.flush()
        return self._take(len(self.text))  # without stop strings, text holds only the flush

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta
