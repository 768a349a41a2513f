"""The per-step state that caching layers read during a model forward."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

from torch import Tensor

from xinfer.ops import AttentionMetadata, StepContext

if TYPE_CHECKING:
    from xinfer.multimodal.step import MultiModalEmbeddings

_step: StepContext | None = None
T = TypeVar("T")


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


def once_per_step(key: str, sources: tuple[Tensor, ...], compute: Callable[[], T]) -> T:
    """``compute()``, which depends only on ``sources``, computed by the first layer of a forward that
    asks and reused by the others (outside a forward: computed at every call). The sources are kept
    with the value, so a tensor made later cannot take one's place under the same ids."""
    if _step is None:
        return compute()
    name = (key, *map(id, sources))  # (a tuple: no string made per call, which decode steps pay every layer)
    held = _step.derived.get(name)
    if held is None or not all(map(operator.is_, held[0], sources)):  # (no generator: every layer asks)
        held = _step.derived[name] = (sources, compute())
    return held[1]


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
