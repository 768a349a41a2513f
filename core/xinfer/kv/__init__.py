"""KV cache formats: layouts, real sizes, and reference quantize/dequantize."""

from xinfer.kv.format import KVFormat, LayerKVCache
from xinfer.kv.formats import formats, get_format

__all__ = ["KVFormat", "LayerKVCache", "formats", "get_format"]
