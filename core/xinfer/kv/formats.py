"""The registry of KV cache formats by name (the ``kv_cache_dtype`` option)."""

from __future__ import annotations

from xinfer.kv.codecs import Fp8, LloydMax, Plain, Uniform
from xinfer.kv.format import KVFormat

FOUR_BIT = Uniform(levels=16, bits=4)
THREE_BIT = Uniform(levels=7, bits=3)

FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("auto", Plain(), Plain()),
        KVFormat("fp8", Fp8(), Fp8()),
        KVFormat("turbo8", Fp8(), FOUR_BIT),
        KVFormat("turbo4", FOUR_BIT, FOUR_BIT, rotate_keys=True),
        KVFormat("turbo3", THREE_BIT, FOUR_BIT, rotate_keys=True),
        # Same bits, Gaussian-optimal levels for the rotated keys (all 8 codes at 3 bits).
        KVFormat("turbo4-lm", LloydMax(levels=16, bits=4), FOUR_BIT, rotate_keys=True),
        KVFormat("turbo3-lm", LloydMax(levels=8, bits=3), FOUR_BIT, rotate_keys=True),
    )
}


def get_format(name: str) -> KVFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache format {name!r}; known: {', '.join(FORMATS)}") from None
