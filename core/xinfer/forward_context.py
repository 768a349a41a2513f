"""The per-step state that attention layers read during a model forward."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from xinfer.ops import AttentionMetadata

_metadata: AttentionMetadata | None = None


@contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    global _metadata
    previous, _metadata = _metadata, metadata
    try:
        yield
    finally:
        _metadata = previous


def attention_metadata() -> AttentionMetadata:
    if _metadata is None:
        raise RuntimeError("attention ran outside a forward_context")
    return _metadata
