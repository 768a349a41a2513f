"""Streaming text out of generated token ids, one delta per token.

Decoding a token alone is wrong: SentencePiece drops the leading space of the first piece,
and a character split over byte-fallback tokens decodes to U+FFFD until its last byte
arrives. So each step decodes a short window, ``ids[prefix:]``, and emits what it adds to
``ids[prefix:read]``, the part already emitted; a tail ending in U+FFFD waits for more.
With xinfer's own tokenizer, ``tokenizers``' ``DecodeStream`` does that step in one call
(about 2 µs a token, where two decodes from Python take 6-15); the window then only
serves ``flush``, and the tokens after a byte token of a tokenizer that decodes those
its own way (a GGUF SentencePiece vocabulary: llama.cpp's bytes, not ``tokenizers``').
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenizers.decoders import DecodeStream

from xinfer.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# prompt tokens kept as context for the first generated token (vLLM uses 5 too)
_PROMPT_CONTEXT = 5


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """``push`` each generated id; the deltas (then ``flush``) concatenate to
    ``tokenizer.decode(generated ids)``, or to its continuation of ``prompt_ids``."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix = 0  # ids[prefix:read] is context already emitted
        self.read = len(self.ids)
        # tokenizers' own incremental decoder where ``tokenizer.decode`` is its backend's (xinfer's
        # tokenizer; an HF tokenizer's ``decode`` may also clean up spaces)
        self.backend = tokenizer.backend if isinstance(tokenizer, Tokenizer) else None
        # a tokenizer that decodes byte tokens its own way: the window takes over from the first one
        own = tokenizer.byte_tokens if isinstance(tokenizer, Tokenizer) else None
        self.own_byte_ids = own.byte_ids if own is not None else frozenset()
        self.stream = None
        # DecodeStream would emit again a context that ends inside a character, with the first token's text
        if self.backend is not None and not self._decode(self.ids).endswith(_REPLACEMENT):
            self.stream = DecodeStream(ids=list(self.ids), skip_special_tokens=skip_special_tokens)
        if not self.own_byte_ids.isdisjoint(self.ids):
            self.stream = None

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if token_id in self.own_byte_ids:
            self.stream = None
        text = self._stream_delta(token_id) if self.stream is not None else self._window_delta()
        if text:
            self.prefix, self.read = self.read, len(self.ids)
            self._forget_emitted()
        return text

    def _stream_delta(self, token_id: int) -> str:
        assert self.stream is not None and self.backend is not None
        try:
            return self.stream.step(self.backend, token_id) or ""
        except Exception:  # noqa: BLE001 - its prefix check can fail (tokenizers#1705): the window takes over
            self.stream = None
            return self._window_delta()

    def _window_delta(self) -> str:
        emitted = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(emitted) or text.endswith(_REPLACEMENT):
            return ""
        return text[len(emitted) :]

    def flush(self) -> str:
        """What is still held back (a trailing incomplete character) at the end of a stream."""
        emitted = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _forget_emitted(self) -> None:
        # keep memory O(window): ids before the context window are never decoded again
        if self.prefix > 64:
            del self.ids[: self.prefix]
            self.read -= self.prefix
            self.prefix = 0
