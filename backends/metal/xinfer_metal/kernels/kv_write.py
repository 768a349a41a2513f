"""Storing a step's K and V into the paged cache (kv_write.metal): the model dtype as it is,
quantized formats encoded on the GPU from the basis the format stores."""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer_metal.kernels.codecs import PLAIN, cache_codecs
from xinfer_metal.shaders import MetalLibrary

LIBRARY = MetalLibrary("kv_codes.metal", "kv_write.metal")
COPY_GROUP = 256  # threads of a copy threadgroup
SIMD = 32


def covers(cache: LayerKVCache) -> bool:
    return cache_codecs(cache) is not None


def write_kv(k: Tensor, v: Tensor, cache: LayerKVCache, slot_mapping: Tensor) -> None:
    """Store ``k``, ``v`` [T, Hkv, D] into ``cache`` at ``slot_mapping`` [T] (negative:
    skipped), as :meth:`xinfer.torch_ops.TorchOps.write_kv` does."""
    codecs = cache_codecs(cache)
    assert codecs is not None, f"no Metal kernel stores {cache.format.name} with head_dim {cache.head_dim}"
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    slots = slot_mapping.to(torch.int64).contiguous()
    if codecs[0] in PLAIN.values() and codecs[1] in PLAIN.values():
        row_units = num_kv_heads * head_dim * cache.dtype.itemsize // 2
        LIBRARY.launch(
            "write_kv",
            threads=[row_units, num_tokens],
            group_size=[min(COPY_GROUP, row_units), 1],
            k=_units(k.to(cache.dtype)),
            v=_units(v.to(cache.dtype)),
            k_cache=_units(cache["k"]),
            v_cache=_units(cache["v"]),
            slot_mapping=slots,
            row_units=row_units,
        )
        return
    keys, values = cache.format.stored_basis(k, v, cache.equalizer, cache.key_offset)
    for side, x, codec in (("k", keys, codecs[0]), ("v", values, codecs[1])):
        LIBRARY.launch(
            "quant_write_kv",
            threads=[SIMD * num_kv_heads, num_tokens],
            group_size=[SIMD, 1],
            x=x.float().contiguous(),
            cache=cache[side],
            scales=cache[f"{side}_scale"],
            slot_mapping=slots,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            codec=int(codec),
        )


def _units(x: Tensor) -> Tensor:
    """``x`` as raw 2-byte units (the copy kernel moves bits, whatever the float dtype)."""
    return x.contiguous().view(torch.int16)
