"""Quantized weights: :class:`QuantizedTensor` and the format registry (:mod:`xinfer.quant.tensor`),
the GGUF block formats (:mod:`xinfer.quant.gguf_formats`), and how ops run them
(:mod:`xinfer.quant.dispatch`)."""

from xinfer.quant.tensor import (
    QuantizedTensor,
    WeightFormat,
    WeightKernels,
    cat_rows,
    get_weight_format,
    permute_rows,
    quantized,
    weight_formats,
)

__all__ = [
    "QuantizedTensor",
    "WeightFormat",
    "WeightKernels",
    "cat_rows",
    "get_weight_format",
    "permute_rows",
    "quantized",
    "weight_formats",
]
