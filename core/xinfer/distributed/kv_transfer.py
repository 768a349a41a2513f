"""A prompt's cache moved between two engines of the same model, every kind in its stored bytes.

What moves is a prefix-cache entry: the prefill engine looks the prompt up in its prefix cache
(:meth:`CacheManager.match_prefix`, which it filled by prefilling the prompt) and copies out the
blocks of every page group (full attention, each sliding window: only the blocks the window still
reaches) and, for recurrent layers, the state snapshot; the decode engine writes them into blocks
and a slot of its own and registers them in its prefix cache (:meth:`CacheManager.commit`), where
the prompt then hits. Each layer's cache is moved as the tensors it stores, indexed by block (or
slot) on their first dimension, whatever its kind or KV format: a new cache kind needs no change
here. The prompt's last token (and the partial block before it) is computed by the decode engine,
as after any prefix-cache hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from xinfer.cache.allocate import CacheLayout
from xinfer.cache.block_pool import NO_BLOCK
from xinfer.engine.sequence import Sequence
from xinfer.kv import LayerKVCache
from xinfer.sampling import SamplingParams

if TYPE_CHECKING:
    from xinfer.engine.engine import LLMEngine


def stored_tensors(cache: object) -> list[Tensor]:
    """The tensors a layer's cache stores, each indexed by block (or state slot) first."""
    if isinstance(cache, LayerKVCache):
        return list(cache.tensors.values())
    if isinstance(cache, Tensor):
        return [cache]
    if isinstance(cache, dict):
        return list(cache.values())
    raise TypeError(f"a cache of type {type(cache).__name__} cannot be transferred")


def _tensors(engine: LLMEngine) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Every page group's stored tensors, and the recurrent layers'."""
    layout = CacheLayout.of(engine.model)
    groups = [[t for layer in group.layers for t in stored_tensors(layer.cache)] for group in layout.groups]
    return groups, [t for layer in layout.state_layers for t in stored_tensors(layer.cache)]


def layout_signature(engine: LLMEngine) -> dict[str, Any]:
    """What both engines must agree on for the bytes of one to mean the same in the other."""
    if any(pool.recent_window is not None for pool in engine.cache.pools):
        raise ValueError("prefill/decode disaggregation does not move a recent window's shadow blocks yet")
    groups, states = _tensors(engine)
    return {
        "block_size": engine.cache.block_size,
        "groups": [[[list(t.shape[1:]), str(t.dtype)] for t in tensors] for tensors in groups],
        "states": [[list(t.shape[1:]), str(t.dtype)] for t in states],
    }


def _rows(engine: LLMEngine, seq: Sequence) -> list[tuple[Tensor, list[int]]]:
    """(tensor, the blocks or slot of ``seq`` it holds), in transfer order."""
    groups, states = _tensors(engine)
    rows = []
    for tensors, table in zip(groups, engine.cache.tables(seq)):
        present = [block for block in table.blocks if block != NO_BLOCK]
        rows += [(t, present) for t in tensors]
    if seq.state_slot is not None:
        rows += [(t, [seq.state_slot]) for t in states]
    return rows


def export_prefix(engine: LLMEngine, token_ids: list[int]) -> tuple[int, Tensor]:
    """The prompt's longest prefix in ``engine``'s prefix cache: its length in tokens, and its
    cache as one byte tensor on the host."""
    manager = engine.cache
    seq = Sequence("pd-export", token_ids, SamplingParams())
    counts = manager.queries, manager.hits
    try:
        num_tokens = manager.match_prefix(seq)
        manager.queries, manager.hits = counts  # a copy, not a request's lookup
        parts = [t[_index(ids, t)].reshape(-1).view(torch.uint8) for t, ids in _rows(engine, seq)] if num_tokens else []
        payload = torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)
    finally:
        manager.release(seq)
    return num_tokens, payload


def import_prefix(engine: LLMEngine, token_ids: list[int], num_tokens: int, payload: Tensor) -> bool:
    """Registers the first ``num_tokens`` of the prompt in ``engine``'s prefix cache with the cache
    :func:`export_prefix` gave for them; False (nothing taken) where the cache has no room."""
    if not num_tokens:
        return False
    manager = engine.cache
    seq = Sequence("pd-import", token_ids, SamplingParams())
    if not manager.allocate(seq, num_tokens):
        return False
    try:
        seq.num_computed_tokens = seq.state_boundary = num_tokens
        manager.trim(seq)  # blocks a window no longer reaches: the prefill engine sent none for them
        offset = 0
        for tensor, ids in _rows(engine, seq):
            shape = (len(ids), *tensor.shape[1:])
            size = torch.Size(shape).numel() * tensor.element_size()
            if offset + size > payload.numel():
                raise ValueError("the prefill server's cache layout differs from this engine's")
            part = payload[offset : offset + size].clone().view(tensor.dtype).view(shape)
            tensor[_index(ids, tensor)] = part.to(tensor.device)
            offset += size
        if offset != payload.numel():
            raise ValueError("the prefill server's cache layout differs from this engine's")
        manager.commit(seq)
    finally:
        manager.release(seq)
    return True


def _index(ids: list[int], tensor: Tensor) -> Tensor:
    return torch.tensor(ids, dtype=torch.long, device=tensor.device)
