"""The CUDA backend's kernels for GGUF-packed weights (:class:`xinfer.quant.WeightKernels`),
declared for every block format :mod:`xinfer_cuda.kernels.gguf_blocks` decodes
(``CudaOps.weight_kernels``): the weight's bytes are read as loaded, never repacked.

Linears go to :func:`xinfer_cuda.kernels.quant_linear.quant_linear` (one row: the GEMV;
more: the dot kernel, whose tiles grow with the rows). Stacked experts go to
:func:`xinfer_cuda.kernels.quant_moe.fused_moe`, which reads each chosen expert once per
slot; past :data:`~xinfer_cuda.kernels.quant_moe.MAX_SLOTS` slots outside a CUDA graph
capture (prefill) the reference's expert-by-expert loop runs instead, each expert's slots
one dot-kernel linear (its weights read once per step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer import ops
from xinfer.quant import QuantizedTensor, WeightKernels
from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import quant_moe
from xinfer_cuda.kernels.gguf_blocks import FORMATS
from xinfer_cuda.kernels.quant_linear import quant_linear


def ggml_type(weight: QuantizedTensor) -> str:
    """The kernels' name of the weight's format (the core names GGUF formats in lower case)."""
    return weight.format.name.upper()


class GgufKernels(WeightKernels):
    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = quant_linear(rows, weight.raw, ggml_type(weight), bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def fused_moe(
        self,
        x: Tensor,
        w13: QuantizedTensor,
        w2: QuantizedTensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        activation: str,
    ) -> Tensor:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if topk_ids.numel() > quant_moe.MAX_SLOTS and not capturing:
            return TorchOps.fused_moe(ops.current(), x, w13, w2, topk_weights, topk_ids, activation)
        return quant_moe.fused_moe(x, w13.raw, w2.raw, ggml_type(w13), topk_weights, topk_ids, activation)


GGUF_KERNELS = GgufKernels()
WEIGHT_KERNELS = {name.lower(): "xinfer_cuda.quant_weights:GGUF_KERNELS" for name in FORMATS}
