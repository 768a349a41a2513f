"""A prompt's cache moved between two engines of the same model, every kind in its stored bytes.

What moves is a prefix-cache entry: the prefill engine looks the prompt up in its prefix cache
(:meth:`CacheManager.match_prefix`, which it filled by prefilling the prompt) and holds the blocks
of every page group (full attention, each sliding window: only the blocks the window still
reaches) and, for recurrent layers, the state snapshot; the decode engine writes them into blocks
and a slot of its own and registers them in its prefix cache (:meth:`CacheManager.commit`), where
the prompt then hits. Each layer's cache is moved as the tensors it stores, indexed by block (or
slot) on their first dimension, whatever its kind or KV format: a new cache kind needs no change
here. The prompt's last token (and the partial block before it) is computed by the decode engine,
as after any prefix-cache hit.

The rows go one of two ways: packed into one byte payload (:func:`export_prefix`, then
:func:`import_prefix`: one gather per tensor into one buffer on the cache's device, one copy to
pinned host memory, and back the same way), or read in place from the prefill engine's cache
mapped into the decode process (:func:`hold_prefix`, then :func:`copy_prefix`: one gather-scatter
per tensor, device to device).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from xinfer.cache.allocate import CacheLayout
from xinfer.cache.block_pool import NO_BLOCK
from xinfer.distributed.shared_memory import open_shared, share
from xinfer.engine.sequence import Sequence
from xinfer.kv import LayerKVCache
from xinfer.sampling import SamplingParams

if TYPE_CHECKING:
    from xinfer.engine.engine import LLMEngine

Row = tuple[Tensor, list[int]]  # a stored tensor, and the blocks (or state slot) of a prompt it holds
ALIGN = 16  # bytes: every row starts aligned in a payload, so that it is viewed in its dtype without a copy


def stored_tensors(cache: object) -> list[Tensor]:
    """The tensors a layer's cache stores, each indexed by block (or state slot) first."""
    if isinstance(cache, LayerKVCache):
        return list(cache.tensors.values())
    if isinstance(cache, Tensor):
        return [cache]
    if isinstance(cache, dict):
        return list(cache.values())
    raise TypeError(f"a cache of type {type(cache).__name__} cannot be transferred")


def cache_tensors(engine: LLMEngine) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Every page group's stored tensors, and the recurrent layers'."""
    layout = CacheLayout.of(engine.model)
    groups = [[t for layer in group.layers for t in stored_tensors(layer.cache)] for group in layout.groups]
    return groups, [t for layer in layout.state_layers for t in stored_tensors(layer.cache)]


def share_cache(engine: LLMEngine) -> dict[str, Any]:
    """Handles to ``engine``'s cache tensors for another process of this host (:func:`open_cache`)."""
    groups, states = cache_tensors(engine)
    return share([t for tensors in groups for t in tensors] + states)


def open_cache(engine: LLMEngine, handles: dict[str, Any]) -> tuple[list[list[Tensor]], list[Tensor]]:
    """The cache tensors :func:`share_cache` gave handles to, mapped here and grouped as
    :func:`cache_tensors` groups ``engine``'s own (of the same layout)."""
    groups, states = cache_tensors(engine)
    mapped = iter(open_shared(handles))
    return [[next(mapped) for _ in tensors] for tensors in groups], [next(mapped) for _ in states]


def layout_signature(engine: LLMEngine) -> dict[str, Any]:
    """What both engines must agree on for the bytes of one to mean the same in the other."""
    if any(pool.recent_window is not None for pool in engine.cache.pools):
        raise ValueError("prefill/decode disaggregation does not move a recent window's shadow blocks yet")
    groups, states = cache_tensors(engine)
    return {
        "block_size": engine.cache.block_size,
        "groups": [[[list(t.shape[1:]), str(t.dtype)] for t in tensors] for tensors in groups],
        "states": [[list(t.shape[1:]), str(t.dtype)] for t in states],
    }


def held_ids(engine: LLMEngine, seq: Sequence) -> tuple[list[list[int]], int | None]:
    """The blocks of each page group that ``seq`` holds, and its state slot."""
    return [[b for b in table.blocks if b != NO_BLOCK] for table in engine.cache.tables(seq)], seq.state_slot


def rows_of(groups: list[list[Tensor]], states: list[Tensor], ids: tuple[list[list[int]], int | None]) -> list[Row]:
    """(tensor, the blocks or slot it holds), in transfer order, for the ids :func:`held_ids` gives."""
    blocks, slot = ids
    rows = [(t, present) for tensors, present in zip(groups, blocks, strict=True) for t in tensors]
    return rows + ([(t, [slot]) for t in states] if slot is not None else [])


def _rows(engine: LLMEngine, seq: Sequence) -> list[Row]:
    return rows_of(*cache_tensors(engine), held_ids(engine, seq))


def _offsets(rows: list[Row]) -> tuple[list[int], int]:
    """Where each row starts in a payload, and the payload's size in bytes."""
    offsets, end = [], 0
    for tensor, ids in rows:
        offsets.append(end)
        end += -(-len(ids) * tensor[0].nbytes // ALIGN) * ALIGN
    return offsets, end


def _views(payload: Tensor, rows: list[Row]) -> list[Tensor]:
    """Each row's part of ``payload``, in the row's dtype and shape."""
    offsets, size = _offsets(rows)
    if size != payload.numel():
        raise ValueError("the prefill server's cache layout differs from this engine's")
    views = []
    for (tensor, ids), offset in zip(rows, offsets):
        shape = (len(ids), *tensor.shape[1:])
        views.append(payload[offset : offset + len(ids) * tensor[0].nbytes].view(tensor.dtype).view(shape))
    return views


def hold_prefix(engine: LLMEngine, token_ids: list[int]) -> tuple[Sequence, int]:
    """The prompt's longest prefix in ``engine``'s prefix cache, held (its blocks neither evicted nor
    reused) until ``engine.cache.release(seq)``, and its length in tokens."""
    manager = engine.cache
    seq = Sequence("pd-export", token_ids, SamplingParams())
    counts = manager.queries, manager.hits
    num_tokens = manager.match_prefix(seq)
    manager.queries, manager.hits = counts  # a copy, not a request's lookup
    return seq, num_tokens


def export_prefix(engine: LLMEngine, token_ids: list[int]) -> tuple[int, Tensor]:
    """The prompt's longest prefix in ``engine``'s prefix cache: its length in tokens, and its
    cache as one byte tensor in host memory (pinned where the cache is on an accelerator)."""
    seq, num_tokens = hold_prefix(engine, token_ids)
    try:
        if not num_tokens:
            return 0, torch.empty(0, dtype=torch.uint8)
        rows = _rows(engine, seq)
        device = rows[0][0].device
        staged, index = torch.empty(_offsets(rows)[1], dtype=torch.uint8, device=device), _indexer(device)
        for (tensor, ids), view in zip(rows, _views(staged, rows)):
            torch.index_select(tensor, 0, index(ids), out=view)
        if device.type == "cpu":
            return num_tokens, staged
        return num_tokens, engine.ops.host_buffer(tuple(staged.shape), torch.uint8).copy_(staged)
    finally:
        engine.cache.release(seq)


def import_prefix(engine: LLMEngine, token_ids: list[int], num_tokens: int, payload: Tensor) -> bool:
    """Registers the first ``num_tokens`` of the prompt in ``engine``'s prefix cache with the cache
    :func:`export_prefix` gave for them; False (nothing taken) where the cache has no room."""

    def unpack(rows: list[Row]) -> None:
        device = rows[0][0].device
        views, index = _views(payload.to(device, non_blocking=True), rows), _indexer(device)
        for (tensor, ids), view in zip(rows, views):
            tensor.index_copy_(0, index(ids), view)

    return _register(engine, token_ids, num_tokens, unpack)


def copy_prefix(
    engine: LLMEngine, token_ids: list[int], num_tokens: int, sources: list[Row], held_until: float = math.inf
) -> bool:
    """Registers the first ``num_tokens`` of the prompt in ``engine``'s prefix cache, its cache read
    from ``sources`` (the prefill engine's tensors and the blocks it holds for the prompt, in the
    order of :func:`rows_of`, until ``time.monotonic()`` is ``held_until``), and waits for the
    copies: the prefill engine may reuse its blocks once this returns. False (nothing taken) where
    the cache has no room; ValueError (nothing taken) where the copies ended after ``held_until``."""

    def copy(rows: list[Row]) -> None:
        shapes = [(len(ids), *t.shape[1:], t.dtype) for t, ids in rows]
        if shapes != [(len(ids), *t.shape[1:], t.dtype) for t, ids in sources]:
            raise ValueError("the prefill server's cache layout differs from this engine's")
        device = rows[0][0].device
        index, source_index = _indexer(device), _indexer(sources[0][0].device)
        for (tensor, ids), (source, source_ids) in zip(rows, sources):
            tensor.index_copy_(0, index(ids), source.index_select(0, source_index(source_ids)).to(device))
        if device.type != "cpu":
            torch.accelerator.synchronize(device)
        if time.monotonic() > held_until:
            raise ValueError("the prefill server's blocks were no longer held when their copy ended")

    return _register(engine, token_ids, num_tokens, copy)


def _register(engine: LLMEngine, token_ids: list[int], num_tokens: int, fill: Callable[[list[Row]], None]) -> bool:
    """Allocates blocks (and a slot) for the prompt's first ``num_tokens``, has ``fill`` write
    their rows, and registers them in the prefix cache."""
    if not num_tokens:
        return False
    manager = engine.cache
    seq = Sequence("pd-import", token_ids, SamplingParams())
    if not manager.allocate(seq, num_tokens):
        return False
    try:
        seq.num_computed_tokens = seq.state_boundary = num_tokens
        manager.trim(seq)  # blocks a window no longer reaches: the prefill engine sent none for them
        fill(_rows(engine, seq))
        manager.commit(seq)
    finally:
        manager.release(seq)
    return True


def _indexer(device: torch.device) -> Callable[[list[int]], Tensor]:
    """Block ids as index tensors on ``device``, each list made once (a page group's tensors share theirs)."""
    made = functools.cache(lambda ids: torch.tensor(ids, dtype=torch.long, device=device))
    return lambda ids: made(tuple(ids))
