"""The core's own hook implementations (registered below every plugin): the quantized KV cache
formats and the GGUF weight formats."""

from xinfer.kv.builtin import xinfer_kv_formats
from xinfer.quant.gguf_formats import xinfer_weight_formats

__all__ = ["xinfer_kv_formats", "xinfer_weight_formats"]
