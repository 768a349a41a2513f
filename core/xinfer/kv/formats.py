"""KV cache formats by name (the ``kv_cache_dtype`` option). ``auto``, the model dtype, is
the core's; every other format is registered through the ``xinfer_kv_formats`` hook, the
built-in quantized ones (:mod:`xinfer.kv.builtin`) too."""

from __future__ import annotations

from xinfer.kv.codecs import Plain
from xinfer.kv.format import KVFormat

AUTO = KVFormat("auto", Plain(), Plain())


def formats() -> dict[str, KVFormat]:
    """Every format a run may choose, by name."""
    from xinfer import registry

    return {"auto": AUTO, **registry.kv_formats()}


def get_format(name: str) -> KVFormat:
    if name == "auto":
        return AUTO
    known = formats()
    if name not in known:
        raise ValueError(f"unknown KV cache format {name!r}; known: {', '.join(known)}")
    return known[name]
