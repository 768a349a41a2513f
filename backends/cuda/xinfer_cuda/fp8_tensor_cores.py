"""FP8 weights (:mod:`xinfer.quant.fp8_format`) through Hopper's FP8 tensor cores: the default on SM90,
where it measured faster than the weight-only kernels (which decode e4m3 in registers on any GPU) at one
row and at 256 (``benchmarks/quant_decode.py --fp8``, which times both: ``XINFER_FP8_MATMUL=weight-only``
or ``tensor-cores`` overrides the choice).

At load each 2-D weight is repacked, in its own bytes, into what ``torch.nn.functional.scaled_mm``'s
1x128 x 1x128 block scaling reads: the e4m3 codes [N, K] row-major, then the float32 scales
[K / 128, N] (the same values: :class:`Fp8TensorCoreLayout`). Each call quantizes the activations to
e4m3 per token and 128 columns (the scale taking each group's largest magnitude to 448) and multiplies
in FP8 with fp32 accumulation; one row takes a GEMV over the same bytes where it measures faster
(:mod:`xinfer_cuda.kernels.fp8_gemv`: cuBLAS has no one-row block-scaled product, and padded to 16 rows
it reads as much as a GEMV but quantizes the activations first). Stacked experts keep the weight-only
layout and kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from xinfer.quant import QuantizedTensor, WeightFormat, WeightKernels
from xinfer.quant.fp8_format import BLOCK, E4M3_MAX
from xinfer_cuda.kernels.fp8_gemv import fp8_gemv
from xinfer_cuda.linear import graph_time, l2_overflowing_copies, time_each
from xinfer_cuda.quant_weights import GgufKernels
from xinfer_cuda.tile_cache import TILE_CACHE, NotMeasured, remembered

SELECT = "XINFER_FP8_MATMUL"  # "auto" (the default: tensor cores on SM90), "weight-only" or "tensor-cores"


class Fp8TensorCoreLayout(WeightFormat):
    """A weight [N, K] as N * K e4m3 codes then K / 128 x N float32 scales, in a uint8 tensor of the
    FP8 format's shape [N, K / 128 * 132] (the same bytes, moved)."""

    name = "fp8_tensor_cores"
    block_values = BLOCK
    block_bytes = BLOCK + 4
    kernels = {"cuda": "xinfer_cuda.fp8_tensor_cores:TENSOR_CORE_KERNELS"}

    def dequantize(self, raw: Tensor) -> Tensor:
        codes, scales = split(raw)
        return codes.float() * scales.t().repeat_interleave(BLOCK, dim=1)


LAYOUT = Fp8TensorCoreLayout()


def split(raw: Tensor) -> tuple[Tensor, Tensor]:
    """The codes [N, K] (e4m3) and the scales [K / 128, N] of a weight in :class:`Fp8TensorCoreLayout`."""
    rows, cols = raw.shape[0], raw.shape[1] // (BLOCK + 4) * BLOCK
    flat = raw.reshape(-1)
    codes = flat[: rows * cols].view(torch.float8_e4m3fn).view(rows, cols)
    return codes, flat[rows * cols :].view(torch.float32).view(cols // BLOCK, rows)


def to_tensor_core_layout(weight: QuantizedTensor) -> QuantizedTensor:
    rows, cols = weight.logical_shape
    blocks = weight.raw.reshape(rows, cols // BLOCK, BLOCK + 4)
    scales = blocks[..., :4].contiguous().view(torch.float32).reshape(rows, cols // BLOCK)
    raw = torch.cat([blocks[..., 4:].reshape(-1), scales.t().contiguous().view(torch.uint8).reshape(-1)])
    return QuantizedTensor(raw.view(weight.raw.shape), LAYOUT, weight.logical_shape)


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` [M, K] as e4m3 codes and one float32 scale per row and 128 columns, the scales [M, K / 128]
    laid out column-major (as scaled_mm reads them)."""
    groups = x.float().unflatten(-1, (-1, BLOCK))
    scales = groups.abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
    codes = (groups / scales[..., None]).to(torch.float8_e4m3fn).flatten(-2)
    # column-major with strides (1, M) even for one row (contiguous() keeps a size-1 dim's stride, which scaled_mm refuses)
    column_major = torch.empty_strided(scales.shape, (1, scales.shape[0]), dtype=scales.dtype, device=scales.device)
    return codes, column_major.copy_(scales)


MIN_ROWS = 16  # see padded_rows


class Fp8TensorCores(WeightKernels):
    """Many rows through ``scaled_mm``; one row (decode at batch 1) through :func:`~xinfer_cuda.kernels.fp8_gemv.fp8_gemv`
    over the same bytes where it measures faster than the tensor cores' product padded to 16 rows (timed once per
    weight shape, outside a CUDA graph capture, and kept in the tile cache as the other measured tiles are; a
    capture that meets an unmeasured shape takes the GEMV)."""

    def __init__(self) -> None:
        self.one_row: dict[tuple, int] = {}  # the GEMV's warps, or 0: the tensor cores

    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        codes, scales = split(weight.raw)
        warps = self.one_row_warps(rows, weight.raw, bias) if rows.shape[0] == 1 and rows.is_cuda else 0
        y = fp8_gemv(rows, codes, scales, bias, warps) if warps else tensor_core_product(rows, codes, scales, bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def one_row_warps(self, x: Tensor, raw: Tensor, bias: Tensor | None) -> int:
        key = (tuple(raw.shape), x.dtype, bias is not None, x.device)
        if key not in self.one_row:
            if torch.cuda.is_current_stream_capturing():
                return GEMV_WARPS[0]
            options = (*GEMV_WARPS, 0)
            self.one_row[key] = remembered(TILE_CACHE, x.device, ("fp8-one-row", *key[:-1]), options,
                                           lambda: self.fastest(x, raw, bias, options))  # fmt: skip
        return self.one_row[key]

    @staticmethod
    def fastest(x: Tensor, raw: Tensor, bias: Tensor | None, options: tuple[int, ...]) -> int:
        def call(warps: int) -> Callable[[Tensor], Tensor]:
            if warps:
                return lambda w: fp8_gemv(x, *split(w), bias, warps)
            return lambda w: tensor_core_product(x, *split(w), bias)

        try:
            times = time_each(graph_time, {w: call(w) for w in options}, l2_overflowing_copies(raw), x.device)
        except torch.OutOfMemoryError as error:
            raise NotMeasured(options[0]) from error
        return min(times, key=times.__getitem__) if times else 0  # (none fit: the tensor cores)


GEMV_WARPS = (4, 8)


def tensor_core_product(rows: Tensor, codes: Tensor, scales: Tensor, bias: Tensor | None) -> Tensor:
    """``rows`` [M, K] times the weight through ``scaled_mm``, the activations quantized per token and 128
    columns (the rows padded with zeros to :func:`padded_rows`)."""
    m = rows.shape[0]
    padded = F.pad(rows, (0, 0, 0, padded_rows(m) - m)) if padded_rows(m) > m else rows
    x_codes, x_scales = quantize_activations(padded)
    recipe = F.ScalingType.BlockWise1x128
    y = F.scaled_mm(x_codes, codes.t(), x_scales, recipe, scales.t(), recipe, bias=bias, output_dtype=rows.dtype)
    return y[:m]


def padded_rows(m: int) -> int:
    """cuBLAS (12.x, H100 and H200, 2026-12) finds no algorithm for a block-scaled product of fewer than
    :data:`MIN_ROWS` rows or of a row count that is not a multiple of 4 (CUBLAS_STATUS_NOT_SUPPORTED from its
    heuristic: 17 and 37 rows refused, 16, 20, 36, 40 and 300 taken)."""
    return max(MIN_ROWS, -(-m // 4) * 4)


class Fp8Kernels(GgufKernels):
    """The weight-only kernels, and the repack for the tensor cores on SM90 (unless told otherwise)."""

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        selected = os.environ.get(SELECT, "auto")
        if selected not in ("auto", "weight-only", "tensor-cores"):
            raise ValueError(f"{SELECT}={selected!r}: choose auto, weight-only or tensor-cores")
        if selected == "weight-only" or weight.dim() != 2 or weight.is_meta:  # meta: the fit check's, same bytes
            return weight
        hopper = weight.is_cuda and torch.cuda.get_device_capability(weight.device)[0] == 9
        if not hopper and selected == "tensor-cores":
            raise ValueError(f"{SELECT}=tensor-cores runs on SM90 GPUs (Hopper) only")
        return to_tensor_core_layout(weight) if hopper else weight


FP8_KERNELS = Fp8Kernels()
TENSOR_CORE_KERNELS = Fp8TensorCores()
