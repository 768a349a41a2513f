"""The registry of KV cache formats by name (the ``kv_cache_dtype`` option)."""

from __future__ import annotations

from xinfer.kv.codecs import Fp8, LloydMax, Plain, Uniform
from xinfer.kv.format import KVFormat

EIGHT_BIT = Uniform(levels=255, bits=8)
FOUR_BIT = Uniform(levels=16, bits=4)
# All 8 codes on a grid of 2.2 RMS: on real models' rotated keys as good as Lloyd–Max
# levels (docs/kv-cache.md), at the decode cost of any uniform code.
THREE_BIT = Uniform(levels=8, bits=3, rms_clip=2.2)

FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("auto", Plain(), Plain()),
        # fp8's values stay unrotated: rotating them too measured worse (docs/kv-cache.md)
        KVFormat("fp8", Fp8(), Fp8(), rotate_keys=True),
        KVFormat("turbo8", EIGHT_BIT, FOUR_BIT, rotate_keys=True, rotate_values=True),
        KVFormat("turbo4", FOUR_BIT, FOUR_BIT, rotate_keys=True, rotate_values=True),
        KVFormat("turbo3", THREE_BIT, FOUR_BIT, rotate_keys=True, rotate_values=True),
        # turbo4 and turbo3 with Gaussian-optimal levels for the rotated keys
        KVFormat("turbo4-lm", LloydMax(levels=16, bits=4), FOUR_BIT, rotate_keys=True, rotate_values=True),
        KVFormat("turbo3-lm", LloydMax(levels=8, bits=3), FOUR_BIT, rotate_keys=True, rotate_values=True),
    )
}


def get_format(name: str) -> KVFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache format {name!r}; known: {', '.join(FORMATS)}") from None
