"""What a layer caches. Each caching layer declares a spec; the engine plans memory,
allocates, prefix-caches and preempts per kind.

Paged kinds keep per-token entries in blocks of ``block_size`` tokens, addressed through a
sequence's page table. Layers whose queries read back the same positions (the same
``window``; None: every position) share one page table and one pool of blocks, so a
sliding-window layer holds only the blocks its window can still see. A recurrent state
is not paged: each running sequence owns one fixed slot of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from xinfer.kv import KVFormat, LayerKVCache


def _nbytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class AttentionSpec:
    """K and V of each of ``num_kv_heads`` heads per token, in the engine's KV format."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None  # a query at p reads keys in (p - window, p]

    def bytes_per_token(self, kv_format: KVFormat, dtype: torch.dtype) -> int:
        return self.num_kv_heads * kv_format.bytes_per_token(self.head_dim, dtype)

    def block_bytes(self, kv_format: KVFormat, dtype: torch.dtype, block_size: int) -> int:
        return self.bytes_per_token(kv_format, dtype) * block_size

    def allocate(
        self, num_blocks: int, block_size: int, kv_format: KVFormat, dtype: torch.dtype, device: torch.device
    ) -> LayerKVCache:
        return kv_format.allocate(num_blocks, block_size, self.num_kv_heads, self.head_dim, dtype, device)


@dataclass(frozen=True)
class TokenVectorSpec:
    """One vector of ``width`` values per token shared by every head: multi-head latent
    attention's latent (its normalised latent and rotated rope key, 576 values in DeepSeek
    V3), or an indexer's key (DeepSeek V3.2). Stored in ``dtype`` (default: the model's), or,
    under a KV format named in ``encoded``, as that spec says (the layer reads its cache's
    dtype to know which); under any other format, as it is.

    With ``ratio`` > 1, one vector per ``ratio`` tokens (a compressed entry: DeepSeek V4's pooled
    keys), the one of positions ``[w * ratio, (w + 1) * ratio)`` kept in the block of its last
    position, row ``(last % block_size) // ratio`` of the ``rows_per_block`` a block holds
    (:func:`compressed_slots`). That block's prefix-cache hash covers every position the vector
    was computed from, so a shared block never holds a vector of another sequence's later tokens.
    ``ratio`` divides ``block_size`` (each block holds ``block_size / ratio`` vectors, no waste),
    or ``block_size`` divides ``ratio`` (one row per block, of which only every
    ``ratio / block_size``-th block's is used: a larger ``block_size`` wastes less)."""

    width: int
    dtype: torch.dtype | None = None
    window: int | None = None
    encoded: Mapping[str, TokenVectorSpec] = field(default_factory=dict, hash=False)  # by KV format name
    ratio: int = 1

    def stored(self, kv_format: KVFormat) -> TokenVectorSpec:
        return self.encoded.get(kv_format.name, self)

    def bytes_per_token(self, kv_format: KVFormat, dtype: torch.dtype) -> int:
        """Bytes per token of a ``ratio`` 1 vector (of a compressed one: :meth:`block_bytes`)."""
        spec = self.stored(kv_format)
        return spec.width * _nbytes(spec.dtype or dtype)

    def rows_per_block(self, block_size: int) -> int:
        if block_size % self.ratio and self.ratio % block_size:
            raise ValueError(
                f"a vector per {self.ratio} tokens needs a block size that divides or is a multiple of "
                f"{self.ratio}; got block_size {block_size}"
            )
        return max(1, block_size // self.ratio)

    def block_bytes(self, kv_format: KVFormat, dtype: torch.dtype, block_size: int) -> int:
        return self.bytes_per_token(kv_format, dtype) * self.rows_per_block(block_size)

    def allocate(
        self, num_blocks: int, block_size: int, kv_format: KVFormat, dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        spec = self.stored(kv_format)
        rows = self.rows_per_block(block_size)
        return torch.zeros(num_blocks, rows, spec.width, dtype=spec.dtype or dtype, device=device)


def compressed_slots(slot_mapping: Tensor, positions: Tensor, ratio: int, block_size: int) -> Tensor:
    """The rows of a ``ratio`` cache (``TokenVectorSpec.ratio``; the cache viewed as
    [num_blocks * rows_per_block, width]) where the tokens at ``positions`` that end a run of
    ``ratio`` store its vector; -1 for the other tokens and for skipped slots (negative)."""
    rows = max(1, block_size // ratio)
    row = (slot_mapping // block_size) * rows + (slot_mapping % block_size) // ratio
    return torch.where((slot_mapping >= 0) & ((positions + 1) % ratio == 0), row, -1)


def compressed_rows(block_table: Tensor, count: int, ratio: int, block_size: int) -> Tensor:
    """The rows (as :func:`compressed_slots` numbers them) of one sequence's first ``count``
    vectors of a ``ratio`` cache, in order."""
    rows = max(1, block_size // ratio)
    last = (torch.arange(count, device=block_table.device) + 1) * ratio - 1
    return block_table[last // block_size].long() * rows + (last % block_size) // ratio


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A fixed state per running sequence: tensors of the given shapes (e.g. a causal
    convolution's last inputs and a linear-attention state matrix), in ``dtype``
    (default: the model's)."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dtype: torch.dtype | None = None

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        return sum(torch.Size(shape).numel() for shape in self.shapes.values()) * _nbytes(self.dtype or dtype)

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
        return {
            name: torch.zeros(num_slots, *shape, dtype=self.dtype or dtype, device=device)
            for name, shape in self.shapes.items()
        }


PagedSpec = AttentionSpec | TokenVectorSpec
CacheSpec = AttentionSpec | TokenVectorSpec | RecurrentStateSpec


@runtime_checkable
class CachingLayer(Protocol):
    """A module that caches: it declares what, and the engine binds what it allocated
    (``cache``) and, for paged kinds, the page table it reads (``page_group``)."""

    cache: object
    page_group: int

    def cache_spec(self) -> CacheSpec: ...


def caching_layers(model: torch.nn.Module) -> list[CachingLayer]:
    return [m for m in model.modules() if isinstance(m, CachingLayer)]


@dataclass(frozen=True)
class PageGroup:
    """Layers that read back the same positions, and so share page tables and a pool."""

    window: int | None
    layers: tuple[CachingLayer, ...]
    specs: tuple[PagedSpec, ...]

    def bytes_per_token(self, kv_format: KVFormat, dtype: torch.dtype) -> int:
        return sum(spec.bytes_per_token(kv_format, dtype) for spec in self.specs)

    def block_bytes(self, kv_format: KVFormat, dtype: torch.dtype, block_size: int) -> int:
        return sum(spec.block_bytes(kv_format, dtype, block_size) for spec in self.specs)


def page_groups(layers: list[CachingLayer]) -> list[PageGroup]:
    """The paged layers grouped by window: every position first, then the widest window."""
    by_window: dict[int | None, list[tuple[CachingLayer, PagedSpec]]] = {}
    for layer in layers:
        spec = layer.cache_spec()
        if not isinstance(spec, RecurrentStateSpec):
            by_window.setdefault(spec.window, []).append((layer, spec))
    order = sorted(by_window, key=lambda window: (window is not None, -(window or 0)))
    return [PageGroup(w, tuple(layer for layer, _ in by_window[w]), tuple(s for _, s in by_window[w])) for w in order]


def state_layers(layers: list[CachingLayer]) -> list[CachingLayer]:
    return [layer for layer in layers if isinstance(layer.cache_spec(), RecurrentStateSpec)]
