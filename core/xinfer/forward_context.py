"""The per-step state that caching layers read during a model forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from torch import Tensor

from xinfer.ops import AttentionMetadata, StepContext

if TYPE_CHECKING:
    from xinfer.multimodal.step import MultiModalEmbeddings

_step: StepContext | None = None


@contextmanager
def forward_context(step: StepContext) -> Iterator[None]:
    global _step
    previous, _step = _step, step
    step.derived.clear()
    try:
        yield
    finally:
        _step = previous


def step_context() -> StepContext:
    if _step is None:
        raise RuntimeError("a caching layer ran outside a forward_context")
    return _step


def attention_metadata(page_group: int = 0) -> AttentionMetadata:
    """Where the step's queries sit, and the KV of ``page_group``'s layers."""
    return step_context().pages[page_group]


def state_slots() -> Tensor:
    """Each sequence's recurrent-state slot [B]."""
    slots = step_context().state_slots
    if slots is None:
        raise RuntimeError("this step carries no recurrent-state slots: the model declared no RecurrentStateSpec")
    return slots


def multimodal() -> MultiModalEmbeddings | None:
    """The encoder embeddings this step's image tokens take, if it has any (outside a step: none)."""
    return _step.multimodal if _step is not None else None
