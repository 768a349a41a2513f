"""A KV cache format (a K codec, a V codec, and which sides are rotated) and the
per-layer cache it allocates."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from xinfer.kv import hadamard
from xinfer.kv.codecs import Codec, Field
from xinfer.kv.equalizer import divide_keys, scale_queries
from xinfer.kv.key_offset import subtract_offset


@dataclass(frozen=True)
class KVFormat:
    name: str
    key: Codec
    value: Codec
    rotate_keys: bool = False
    rotate_values: bool = False

    def refuse_head_dims(self, head_dims: set[int]) -> None:
        """One error where a side is rotated (a Walsh-Hadamard transform: powers of two only) and a head dim is not
        a power of two."""
        odd = sorted(n for n in head_dims if n & (n - 1))
        if odd and (self.rotate_keys or self.rotate_values):
            raise ValueError(
                f"kv_cache_dtype (--kvcache-dtype) {self.name!r} rotates each head by a Walsh-Hadamard transform, "
                f"which takes a power-of-two head dim; this model's attention heads have {', '.join(map(str, odd))} "
                "dims: use auto"
            )

    def fields(self, head_dim: int, dtype: torch.dtype) -> dict[str, Field]:
        """Stored tensors by name ("k", "k_scale", "v", ...)."""
        named = {"k" + f.suffix: f for f in self.key.fields(head_dim, dtype)}
        named |= {"v" + f.suffix: f for f in self.value.fields(head_dim, dtype)}
        return named

    def bytes_per_token(self, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> int:
        """Real bytes of K and V of one token for one KV head."""
        return sum(f.nbytes for f in self.fields(head_dim, dtype).values())

    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> LayerKVCache:
        tensors = {
            name: torch.zeros((num_blocks, block_size, num_kv_heads, *f.trailing), dtype=f.dtype, device=device)
            for name, f in self.fields(head_dim, dtype).items()
        }
        return LayerKVCache(self, tensors, head_dim, dtype)

    def quantize(
        self,
        k: Tensor,
        v: Tensor,
        dtype: torch.dtype | None = None,
        equalizer: Tensor | None = None,
        key_offset: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """k, v [..., Hkv, D] -> stored tensors [..., *trailing] by name: encoded in the
        basis :meth:`stored_basis` brings them to."""
        dtype = dtype or k.dtype
        names = list(self.fields(k.shape[-1], dtype))
        keys, values = self.stored_basis(k, v, equalizer, key_offset)
        stored = self.key.encode(keys, dtype) + self.value.encode(values, dtype)
        return dict(zip(names, stored))

    def stored_basis(
        self, k: Tensor, v: Tensor, equalizer: Tensor | None = None, key_offset: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """k, v [..., Hkv, D] as this format encodes them (and :meth:`decode` returns
        them): keys less the layer's ``key_offset`` [Hkv, D] (:mod:`xinfer.kv.key_offset`),
        rotated keys divided by its ``equalizer`` [Hkv, D] (:mod:`xinfer.kv.equalizer`),
        then each rotated side rotated."""
        if key_offset is not None:
            k = subtract_offset(k, key_offset)
        if self.rotate_keys and equalizer is not None:
            k = divide_keys(k, equalizer)
        keys = hadamard.rotate(k) if self.rotate_keys else k
        values = hadamard.rotate(v) if self.rotate_values else v
        return keys, values

    def decode(self, stored: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """fp32 keys and values as attention sees them (in the rotated basis where a side is rotated)."""
        k = self.key.decode([t for n, t in stored.items() if n.startswith("k")])
        v = self.value.decode([t for n, t in stored.items() if n.startswith("v")])
        return k, v

    def dequantize(
        self, stored: dict[str, Tensor], equalizer: Tensor | None = None, key_offset: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """fp32 k, v in the model's basis."""
        k, v = self.decode(stored)
        if self.rotate_keys:
            k = hadamard.unrotate(k)
            k = k * equalizer if equalizer is not None else k
        k = k + key_offset if key_offset is not None else k
        return k, (hadamard.unrotate(v) if self.rotate_values else v)

    def prepare_query(self, q: Tensor, equalizer: Tensor | None = None) -> Tensor:
        """The query [T, H, D] in the keys' basis (fp32 when rotated): scaled by the
        equalizer and rotated like the keys, so no inverse is needed."""
        if not self.rotate_keys:
            return q
        return hadamard.rotate(scale_queries(q, equalizer) if equalizer is not None else q)

    def finish_output(self, out: Tensor) -> Tensor:
        """Attention output back in the model's basis: ``Σ p·(R v) = R (Σ p·v)``, so with
        rotated values one inverse rotation per (token, head) undoes it (fp32 then)."""
        return hadamard.unrotate(out) if self.rotate_values else out


@dataclass
class LayerKVCache:
    """One attention layer's cache: tensors [num_blocks, block_size, Hkv, ...] by name."""

    format: KVFormat
    tensors: dict[str, Tensor]
    head_dim: int
    dtype: torch.dtype  # the model's: what attention computes in
    equalizer: Tensor | None = None  # [Hkv, D] for rotated keys, set once before any write
    key_offset: Tensor | None = None  # [Hkv, D] for rotated keys, likewise
    # Recent window: exact K and V [num_shadows, block_size, Hkv, D] in the stored basis.
    shadows: tuple[Tensor, Tensor] | None = None
    recent_window: int = 0

    @classmethod
    def plain(cls, k_cache: Tensor, v_cache: Tensor) -> LayerKVCache:
        """The ``auto`` format over existing [num_blocks, block_size, Hkv, D] tensors."""
        from xinfer.kv.formats import get_format

        return cls(get_format("auto"), {"k": k_cache, "v": v_cache}, k_cache.shape[-1], k_cache.dtype)

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    @property
    def num_blocks(self) -> int:
        return self["k"].shape[0]

    @property
    def block_size(self) -> int:
        return self["k"].shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self["k"].shape[2]
