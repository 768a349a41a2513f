"""Which of the Metal kernels' codecs (kv_codes.metal) stores each side of a cache."""

from __future__ import annotations

from enum import IntEnum

import torch

from xinfer.kv import KVFormat, LayerKVCache
from xinfer.kv.codecs import Codec as KVCodec
from xinfer.kv.codecs import Fp8, Plain, Uniform


class Codec(IntEnum):
    """kv_codes.metal's codec ids (CI checks that the two agree)."""

    PLAIN_F32 = 0
    PLAIN_F16 = 1
    PLAIN_BF16 = 2
    FP8 = 3
    UNIFORM8 = 4
    UNIFORM4 = 5


PLAIN = {torch.float32: Codec.PLAIN_F32, torch.float16: Codec.PLAIN_F16, torch.bfloat16: Codec.PLAIN_BF16}
UNIFORM = {(255, 8): Codec.UNIFORM8, (16, 4): Codec.UNIFORM4}
"""Uniform codes on the absmax by (levels, bits); those on the RMS (turbo3) and Lloyd-Max levels have no kernel."""


def codec_of(codec: KVCodec, dtype: torch.dtype) -> Codec | None:
    """The kernels' codec storing one side as ``codec`` does (None: none does)."""
    if type(codec) is Plain:
        return PLAIN.get(dtype)
    if type(codec) is Fp8:
        return Codec.FP8
    if type(codec) is Uniform and not codec.scales_by_rms:
        return UNIFORM.get((codec.levels, codec.bits))
    return None


def format_codecs(fmt: KVFormat, dtype: torch.dtype) -> tuple[Codec, Codec] | None:
    """The kernels' codecs of ``fmt``'s keys and values (None: the kernels lack one)."""
    key, value = codec_of(fmt.key, dtype), codec_of(fmt.value, dtype)
    return None if key is None or value is None else (key, value)


def cache_codecs(cache: LayerKVCache) -> tuple[Codec, Codec] | None:
    """The codecs of ``cache``'s two sides, where the kernels read its format and head dim."""
    if cache.head_dim % 2 or cache.head_dim > MAX_HEAD_DIM:
        return None
    return format_codecs(cache.format, cache.dtype)


MAX_HEAD_DIM = 256
"""paged_attention.metal's MAX_HEAD_DIM: each lane of a simdgroup holds up to 4 pairs of elements."""
