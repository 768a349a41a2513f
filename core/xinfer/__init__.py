"""xinfer: an LLM inference engine with architectures and backends as plugins."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from xinfer.api import LLM, CompletionOutput, RequestOutput
    from xinfer.logprob import Logprob
    from xinfer.sampling import SamplingParams

_LAZY = {
    "LLM": "xinfer.api",
    "RequestOutput": "xinfer.api",
    "CompletionOutput": "xinfer.api",
    "SamplingParams": "xinfer.sampling",
    "Logprob": "xinfer.logprob",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'xinfer' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]
