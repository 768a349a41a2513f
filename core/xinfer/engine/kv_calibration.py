"""Calibration of the key transforms of formats that rotate keys: the key offset
(:mod:`xinfer.kv.key_offset`) and the equalizer (:mod:`xinfer.kv.equalizer`). One forward over a fixed text through a temporary
model-dtype cache records, per layer, the per-channel sums of the keys it writes and
of their squares, the energy of the queries it attends with, and whether it caps logits.

Runs once at start-up, before the memory plan: every cache allocated after it (the
plan's one-block cache that its graphs are captured over, then the real cache) gets
the same transforms through :func:`xinfer.cache.allocate.allocate_caches`, so both
captures compile the same kernel variants and every cached block shares them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from xinfer import ops
from xinfer.cache.allocate import CacheLayout, allocate_caches
from xinfer.kv import LayerKVCache, get_format
from xinfer.kv.equalizer import equalizer
from xinfer.ops import HostBatch, PageBatch

CALIBRATION_TOKENS = 512


def calibration_text() -> str:
    """English prose that ships with Python and is not the quality benchmark's text:
    the docstrings of a few standard-library modules."""
    names = ("argparse", "collections", "typing", "json", "logging", "unittest", "subprocess", "threading", "pathlib")
    docs = (importlib.import_module(name).__doc__ for name in names)
    return "\n\n".join(doc for doc in docs if doc)


def calibration_ids(tokenizer: Any, vocab_size: int, max_positions: int) -> list[int]:
    """The calibration text's first tokens, at most :data:`CALIBRATION_TOKENS` and ``max_positions``."""
    count = min(CALIBRATION_TOKENS, max_positions)
    if tokenizer is None:  # e.g. dummy weights: any ids will do
        generator = torch.Generator().manual_seed(0)
        return torch.randint(vocab_size, (count,), generator=generator).tolist()
    return tokenizer.encode(calibration_text(), add_special_tokens=False)[:count]


class KeyStatistics:
    """Ops that record, per cache and per (KV head, channel), the sums of the keys
    written, of their squares and of the squares of the queries attending, and which
    caches cap logits; everything is computed by ``inner``."""

    def __init__(self, inner: ops.Ops):
        self.inner = inner
        self.key_sums: dict[int, Tensor] = {}
        self.key_energy: dict[int, Tensor] = {}
        self.query_energy: dict[int, Tensor] = {}
        self.softcapped: set[int] = set()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, cache: LayerKVCache, meta, scale, window=None, softcap=None
    ) -> Tensor:
        tokens, heads, head_dim = q.shape
        grouped = q.float().view(tokens, cache.num_kv_heads, heads // cache.num_kv_heads, head_dim)
        layer = id(cache)
        self.query_energy[layer] = self.query_energy.get(layer, 0) + grouped.pow(2).sum((0, 2))
        self.key_sums[layer] = self.key_sums.get(layer, 0) + k.float().sum(0)
        self.key_energy[layer] = self.key_energy.get(layer, 0) + k.float().pow(2).sum(0)
        if softcap:
            self.softcapped.add(layer)
        return self.inner.attention(q, k, v, cache, meta, scale, window, softcap)

    def rotary_attention(
        self, q: Tensor, k: Tensor, v: Tensor, rotation: ops.Rotation, cache: LayerKVCache, meta, scale, window=None,
        softcap=None,
    ) -> Tensor:  # fmt: skip
        """The rotary, then :meth:`attention` (recorded) of the rotated queries and keys."""
        q, k = self.inner.rotary(q, k, rotation.positions, rotation.cos_sin, rotation.norms)
        return self.attention(q, k, v, cache, meta, scale, window, softcap)


@dataclass(frozen=True)
class KeyTransforms:
    """Per attention layer, in model order: the key offset (None where the layer caps
    logits) and the equalizer."""

    offsets: list[Tensor | None]
    equalizers: list[Tensor]

    def apply(self, caches: list[LayerKVCache]) -> None:
        for cache, offset, scale in zip(caches, self.offsets, self.equalizers, strict=True):
            cache.key_offset, cache.equalizer = offset, scale


@torch.inference_mode()
def calibrate_keys(
    forward: Callable[[HostBatch], Tensor],
    backend: ops.Ops,
    layout: CacheLayout,
    ids: list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> KeyTransforms:
    """The key offset and equalizer of every attention layer, from one ``forward`` (a batch
    through the model under the ops in use: ``backend``'s, recorded) of ``ids`` at positions
    0, 1, ... whatever the engine's ``max_model_len`` and ``max_num_batched_tokens``: those
    limit requests, and engines that differ only in them must store the same codes. Chunks
    or shorter sequences would not do: they change the keys' positions, or the last bits of
    every later layer's keys. Its activations are released before the memory plan
    measures a step's."""
    num_blocks = -(-len(ids) // block_size)
    previous = [layer.cache for layer in layout.layers]
    allocate_caches(layout, [num_blocks] * len(layout.groups), block_size, dtype, device, get_format("auto"), 1)
    scratch = [layer.cache for layer in layout.attention_layers]
    stats = KeyStatistics(backend)
    page = PageBatch(list(range(len(ids))), [list(range(num_blocks))])
    batch = HostBatch(ids, list(range(len(ids))), [0, len(ids)], [len(ids)], [], [page] * len(layout.groups),
                      [0] if layout.state_layers else [])  # fmt: skip
    try:
        with ops.use(stats):
            forward(batch)
    finally:
        for layer, cache in zip(layout.layers, previous):
            layer.cache = cache
    offsets, equalizers = [], []
    for temp in scratch:
        key_energy = stats.key_energy[id(temp)]
        offset = None
        if id(temp) not in stats.softcapped:
            offset = stats.key_sums[id(temp)] / len(ids)
            key_energy = key_energy - len(ids) * offset.pow(2)  # of the keys as stored
        offsets.append(offset)
        equalizers.append(equalizer(stats.query_energy[id(temp)], key_energy))
    return KeyTransforms(offsets, equalizers)
