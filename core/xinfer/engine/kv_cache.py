"""KV cache allocation: one cache per attention layer, in blocks, in the configured format."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from xinfer.kv import KVFormat
from xinfer.layers.attention import Attention
from xinfer.model import CausalLM

if TYPE_CHECKING:
    from xinfer.engine.kv_calibration import KeyTransforms

CPU_DEFAULT_BUDGET = 2 << 30


def attention_layers(model: CausalLM) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype, kv_format: KVFormat) -> int:
    """Real bytes of one block over all layers, as ``kv_format`` stores them."""
    per_token = sum(a.num_kv_heads * kv_format.bytes_per_token(a.head_dim, dtype) for a in attention_layers(model))
    return per_token * block_size


def host_kv_budget(fraction: float | None) -> int:
    """Bytes of available host memory for the KV cache: ``fraction`` of it, else a
    quarter up to 2 GiB."""
    available = available_host_memory()
    return int(available * fraction) if fraction else min(CPU_DEFAULT_BUDGET, available // 4)


def available_host_memory() -> int:
    """What the kernel could hand out without swapping (Linux's MemAvailable, which
    counts reclaimable page cache; free pages alone can be a small part of it)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def allocate_kv_cache(
    model: CausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_format: KVFormat,
    key_transforms: KeyTransforms | None = None,
    num_shadows: int = 0,
    recent_window: int = 0,
) -> None:
    """Give every attention layer a cache in ``kv_format``, with the calibrated key
    transforms where the format has them (:mod:`xinfer.engine.kv_calibration`), and
    ``num_shadows`` exact blocks for a recent window."""
    layers = attention_layers(model)
    for layer in layers:
        layer.kv_cache = kv_format.allocate(num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype, device)
        if num_shadows:
            shape = (num_shadows, block_size, layer.num_kv_heads, layer.head_dim)
            layer.kv_cache.shadows = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
            layer.kv_cache.recent_window = recent_window
    if key_transforms is not None:
        key_transforms.apply([layer.kv_cache for layer in layers])
