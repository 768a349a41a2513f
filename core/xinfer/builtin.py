"""The core's own hook implementations (registered below every plugin): the quantized KV cache
formats and the weight formats (GGUF's blocks, FP8, MXFP4, NVFP4)."""

from xinfer.hooks import hookimpl
from xinfer.kv.builtin import xinfer_kv_formats
from xinfer.quant.gguf_formats import GGUF_FORMATS

__all__ = ["xinfer_kv_formats", "xinfer_weight_formats"]


@hookimpl
def xinfer_weight_formats() -> dict[str, str]:
    gguf = {f.name: f"xinfer.quant.gguf_formats:{f.__name__}" for f in GGUF_FORMATS}
    fp4 = {"mxfp4": "xinfer.quant.fp4_formats:Mxfp4Format", "nvfp4": "xinfer.quant.fp4_formats:Nvfp4Format"}
    return {**gguf, "fp8": "xinfer.quant.fp8_format:Fp8Format", **fp4}
