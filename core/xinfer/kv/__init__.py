"""KV cache formats: layouts, real sizes, and reference quantize/dequantize."""

from xinfer.kv.format import KVFormat, LayerKVCache
from xinfer.kv.formats import FORMATS, get_format

__all__ = ["FORMATS", "KVFormat", "LayerKVCache", "get_format"]
