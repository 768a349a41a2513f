"""The quantized KV cache formats xinfer ships, registered through the ``xinfer_kv_formats``
hook like any plugin's (the plugin manager registers this module first)."""

from __future__ import annotations

from xinfer.hooks import hookimpl
from xinfer.kv.codecs import Fp8, LloydMax, Uniform
from xinfer.kv.format import KVFormat

EIGHT_BIT = Uniform(levels=255, bits=8)
FOUR_BIT = Uniform(levels=16, bits=4)
# All 8 codes on a grid of 2.2 RMS: on real models' rotated keys as good as Lloyd–Max
# levels (docs/kv-cache.md), at the decode cost of any uniform code.
THREE_BIT = Uniform(levels=8, bits=3, rms_clip=2.2)

# fp8's values stay unrotated: rotating them too measured worse (docs/kv-cache.md)
FP8 = KVFormat("fp8", Fp8(), Fp8(), rotate_keys=True)
TURBO8 = KVFormat("turbo8", EIGHT_BIT, FOUR_BIT, rotate_keys=True, rotate_values=True)
TURBO4 = KVFormat("turbo4", FOUR_BIT, FOUR_BIT, rotate_keys=True, rotate_values=True)
TURBO3 = KVFormat("turbo3", THREE_BIT, FOUR_BIT, rotate_keys=True, rotate_values=True)
# turbo4 and turbo3 with Gaussian-optimal levels for the rotated keys
TURBO4_LM = KVFormat("turbo4-lm", LloydMax(levels=16, bits=4), FOUR_BIT, rotate_keys=True, rotate_values=True)
TURBO3_LM = KVFormat("turbo3-lm", LloydMax(levels=8, bits=3), FOUR_BIT, rotate_keys=True, rotate_values=True)


@hookimpl
def xinfer_kv_formats() -> dict[str, str]:
    names = {"fp8": "FP8", "turbo8": "TURBO8", "turbo4": "TURBO4", "turbo3": "TURBO3",
             "turbo4-lm": "TURBO4_LM", "turbo3-lm": "TURBO3_LM"}  # fmt: skip
    return {name: f"xinfer.kv.builtin:{attribute}" for name, attribute in names.items()}
