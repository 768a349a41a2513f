"""KV cache allocation: one K and one V tensor per attention layer, in blocks."""

from __future__ import annotations

import os

import torch

from xinfer.config import CacheConfig
from xinfer.layers.attention import Attention
from xinfer.model import CausalLM

CPU_DEFAULT_BUDGET = 2 << 30


def attention_layers(model: CausalLM) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def bytes_per_block(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    per_token = sum(2 * a.num_kv_heads * a.head_dim for a in attention_layers(model))
    return per_token * block_size * dtype.itemsize


def plan_num_blocks(model: CausalLM, config: CacheConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Blocks that fit the memory left for the cache (or ``config.num_blocks``)."""
    if config.num_blocks is not None:
        return config.num_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        fraction = config.kv_fraction or 0.9
        budget = free - (1 - fraction) * total
    else:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        budget = available * config.kv_fraction if config.kv_fraction else min(CPU_DEFAULT_BUDGET, available // 4)
    return max(int(budget // bytes_per_block(model, config.block_size, dtype)), 0)


def allocate_kv_cache(
    model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> None:
    for layer in attention_layers(model):
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
