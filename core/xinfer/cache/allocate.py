"""What a model caches (its layout) and the allocation of every caching layer's cache,
in the sizes the memory plan chose."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

from xinfer.cache.specs import (
    CachingLayer,
    PageGroup,
    RecurrentStateSpec,
    caching_layers,
    page_groups,
    state_layers,
)
from xinfer.kv import KVFormat, LayerKVCache
from xinfer.layers.attention import Attention

if TYPE_CHECKING:
    from xinfer.engine.kv_calibration import KeyTransforms


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


@dataclass(frozen=True)
class CacheLayout:
    """A model's caching layers: its page groups, and its recurrent-state layers."""

    layers: list[CachingLayer]  # in model order
    groups: list[PageGroup]
    state_layers: list[CachingLayer]

    @classmethod
    def of(cls, model: torch.nn.Module) -> CacheLayout:
        layers = caching_layers(model)
        return cls(layers, page_groups(layers), state_layers(layers))

    @property
    def attention_layers(self) -> list[CachingLayer]:
        return [layer for layer in self.layers if isinstance(layer, Attention)]

    def block_bytes(self, block_size: int, kv_format: KVFormat, dtype: torch.dtype) -> list[int]:
        """Real bytes of one block of each group, over its layers, as ``kv_format`` stores them."""
        return [group.block_bytes(kv_format, dtype, block_size) for group in self.groups]

    def state_caches(self) -> list[dict[str, Tensor]]:
        """Each recurrent layer's state tensors, as allocated."""
        return [cast(dict[str, Tensor], layer.cache) for layer in self.state_layers]

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's recurrent state over all layers."""
        return sum(_state_spec(layer).bytes_per_slot(dtype) for layer in self.state_layers)


def allocate_caches(
    layout: CacheLayout,
    num_blocks: list[int],
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_format: KVFormat,
    num_state_slots: int = 0,
    key_transforms: KeyTransforms | None = None,
    num_shadows: list[int] | None = None,
    recent_window: int = 0,
) -> None:
    """Give every caching layer its cache: ``num_blocks[g]`` blocks for the layers of page
    group ``g`` (attention in ``kv_format``, with the calibrated key transforms where the
    format has them and ``num_shadows[g]`` exact blocks for a recent window), and
    ``num_state_slots`` slots for each recurrent layer."""
    for index, (group, blocks) in enumerate(zip(layout.groups, num_blocks, strict=True)):
        shadows = num_shadows[index] if num_shadows else 0
        for layer, spec in zip(group.layers, group.specs):
            layer.page_group = index
            cache = spec.allocate(blocks, block_size, kv_format, dtype, device)
            if shadows and isinstance(cache, LayerKVCache):
                shape = (shadows, block_size, cache.num_kv_heads, cache.head_dim)
                k_shadow, v_shadow = (torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
                cache.shadows, cache.recent_window = (k_shadow, v_shadow), recent_window
            layer.cache = cache
    for layer in layout.state_layers:
        layer.cache = _state_spec(layer).allocate(num_state_slots, dtype, device)
    if key_transforms is not None:
        key_transforms.apply(
            [layer.cache for layer in layout.attention_layers if isinstance(layer.cache, LayerKVCache)]
        )


def _state_spec(layer: CachingLayer) -> RecurrentStateSpec:
    spec = layer.cache_spec()
    assert isinstance(spec, RecurrentStateSpec), "state layers cache recurrent state"
    return spec


def bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype, kv_format: KVFormat) -> int:
    """Real bytes of one block of every page group together."""
    return sum(CacheLayout.of(model).block_bytes(block_size, kv_format, dtype))
