"""The CUDA backend's kernels for GGUF-packed and FP8 weights (:class:`xinfer.quant.WeightKernels`),
declared for every block format :mod:`xinfer_cuda.kernels.gguf_blocks` decodes
(``CudaOps.weight_kernels``).

A linear's weight in Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q6_K is re-laid once at load
(``prepare``) into planes (:mod:`xinfer_cuda.kernels.gguf_planes`: the same bytes, codes as
aligned words apart from the scales), a :class:`GgufPlanes` weight whose kernels
(:class:`PlaneKernels`, :mod:`xinfer_cuda.kernels.plane_linear`) decode a value in a few
instructions, or, for 16-bit activations, multiply its codes on the integer tensor cores with the
activations rounded to 8 bits per 32 (:mod:`xinfer_cuda.kernels.plane_i8_dot`, as llama.cpp's batched decode
does), where measured faster; rows of a weight that are looked up (an embedding) and stacked experts keep the
file's blocks, as the other types do.

Linears over the file's blocks go to :func:`xinfer_cuda.kernels.quant_linear.linear_rows` (one row: the GEMV;
more: the dot kernel or the weight dequantized for the call, whichever is faster). For up to
:data:`MEASURED_ROWS` rows (decode steps) the tile is measured per (format, weight shape, row count: 1, up to 16, 32, 64) the first time
one comes up outside a CUDA graph capture (the step graphs' warm-up runs), as
:class:`xinfer_cuda.linear.SmallBatchLinear` does for float weights; past
them (prefill) the weight is dequantized for the call and multiplied densely. Stacked experts go to
:func:`xinfer_cuda.kernels.quant_moe.fused_moe`, which reads each chosen expert once per
slot; past :data:`~xinfer_cuda.kernels.quant_moe.MAX_SLOTS` slots outside a CUDA graph
capture (prefill) the experts go one by one instead, each expert's slots one dot-kernel
linear (its weights read once per step, dequantized past MEASURED_ROWS rows).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from xinfer import ops
from xinfer.quant import QuantizedTensor, WeightFormat, WeightKernels
from xinfer_cuda.kernels import quant_moe
from xinfer_cuda.kernels.gguf_blocks import FORMATS, BlockFormat
from xinfer_cuda.kernels.gguf_planes import LAYOUTS, PlaneLayout, from_planes, to_planes
from xinfer_cuda.kernels.norm import rms_norm
from xinfer_cuda.kernels.plane_i8_dot import PlaneI8DotConfig, quantized_blocks
from xinfer_cuda.kernels.plane_i8_gemv import PlaneI8GemvConfig, quantized_gemv
from xinfer_cuda.kernels.plane_linear import (
    PlaneDotConfig,
    PlaneGemvConfig,
    default_plane_dot,
    default_plane_gemv,
    plane_dequantize,
    plane_rows,
)
from xinfer_cuda.kernels.quant_linear import (
    DEQUANTIZED,
    MAX_PACKED_ROWS,
    Dequantized,
    QDotConfig,
    QGemvConfig,
    default_dot,
    default_gemv,
    linear_rows,
)
from xinfer_cuda.linear import Timer, graph_time, l2_overflowing_copies, time_each
from xinfer_cuda.tile_cache import TILE_CACHE, NotMeasured, TileCache, remembered

log = logging.getLogger("xinfer")
MEASURED_ROWS = MAX_PACKED_ROWS
Tile = QGemvConfig | QDotConfig | PlaneGemvConfig | PlaneDotConfig | PlaneI8GemvConfig | PlaneI8DotConfig | Dequantized
Run = Callable[[Tensor, Tensor, str, Tensor | None, Tile | None], Tensor]  # x, weight bytes, type, bias, tile


def ggml_type(weight: QuantizedTensor) -> str:
    """The kernels' name of the weight's format (the core names GGUF formats in lower case)."""
    return weight.format.name.upper()


# The dots tried: for up to 16 rows (block_n, loop steps, warps, stages, split), past them (block_n, warps,
# split); most also split along K (a decode step's weights of 4,096 rows are 64 tiles of 64 beside 132 SMs).
FEW_ROWS_DOTS = ((32, 1, 4, 3, 1), (64, 1, 4, 3, 1), (32, 2, 4, 3, 1), (64, 2, 4, 4, 1), (128, 1, 8, 3, 1),
                 (32, 1, 4, 3, 4), (64, 1, 4, 3, 4), (64, 2, 4, 4, 2), (128, 1, 8, 3, 4))  # fmt: skip
MANY_ROWS_DOTS = ((32, 4, 1), (64, 4, 1), (128, 8, 1), (64, 4, 4), (128, 8, 2))


def dot_candidates(rows: int, config: type[QDotConfig] | type[PlaneDotConfig], step: int) -> tuple[Tile, ...]:
    """:data:`FEW_ROWS_DOTS` as 16-row tiles, or past 16 :data:`MANY_ROWS_DOTS` as tiles of ``rows``, in
    ``config``, whose loop step is ``step`` units (blocks or tiles) at the least."""
    if rows <= 16:
        return tuple(config(16, n, b * step, w, s, k) for n, b, w, s, k in FEW_ROWS_DOTS)
    return tuple(config(rows, n, step, w, 3, k) for n, w, k in MANY_ROWS_DOTS)


def candidates(fmt: BlockFormat, rows: int) -> tuple[Tile, ...]:
    """The tiles tried for ``rows`` rows (:func:`measured_rows`) of ``fmt``: GEMVs of 2 to 16 weight
    rows a program and 1 or 2 loop steps' blocks for one row, :func:`dot_candidates` past it,
    and the dequantized weight."""
    if rows == 1:
        step = max(1, 256 // fmt.qk)
        return tuple(QGemvConfig(n, b * step, w) for n, b, w in [(4, 1, 4), (2, 2, 4), (8, 1, 4), (4, 2, 8), (8, 2, 8),
                                                                 (16, 1, 8)])  # fmt: skip
    return (*dot_candidates(rows, QDotConfig, max(1, 64 // fmt.qk)), DEQUANTIZED)


# The one-row GEMV's tiles. The first eight give each thread one 16-byte load of codes a row (``tiles =
# 4 * num_warps``: the warps go to the tiles, Triton lays every operand out alike), 1 to 4 rows a
# program, some splitting K; the others keep more of the weight in flight: a warp a row, a group's four
# 16-byte loads a thread (one scale decode for 16 values), the loop unrolled, the first step's loads
# before the chain's wait. (A warp's rows past one, or a thread's loads of several tiles, make Triton
# shuffle operands through shared memory at every step: none of those.)
ONE_ROW_PLANE_TILES = tuple(
    PlaneGemvConfig(*c)
    for c in [(4, 16, 4), (2, 16, 4), (4, 32, 8), (2, 8, 2), (4, 8, 2), (1, 16, 4), (4, 16, 4, 2), (2, 16, 4, 4)]
) + (
    # a warp a row (or two): 4 tiles a step fill a warp's threads, the warps go to the rows; long loops
    PlaneGemvConfig(4, 4, 4, early=True),
    PlaneGemvConfig(8, 4, 8, early=True),
    PlaneGemvConfig(8, 4, 4, early=True),
    PlaneGemvConfig(4, 4, 4, early=True, unroll=2),
    PlaneGemvConfig(8, 4, 8, early=True, unroll=2),
    PlaneGemvConfig(4, 4, 4, split=2, early=True),
    # today's first with its first step before the wait
    PlaneGemvConfig(4, 16, 4, early=True),
    # a group's loads a thread: 16 tiles a step fill a warp's threads (Q6_K's two warps), the rest go to the
    # rows, a thread's rows past one share its activations
    PlaneGemvConfig(4, 16, 4, early=True, groups=True),
    PlaneGemvConfig(8, 16, 4, early=True, groups=True),
    PlaneGemvConfig(8, 16, 8, early=True, groups=True),
    PlaneGemvConfig(16, 16, 8, early=True, groups=True),
    PlaneGemvConfig(8, 16, 4, split=2, early=True, groups=True),
)


# The one-row int8 GEMVs tried: a row a thread won every Llama-3.1-8B shape and type on the H100 (4 warps or 8;
# 2 or 4 rows a thread, and a split of K, never did); 2 warps and 2 rows a thread are there to measure beside them
I8_ONE_ROW_GEMVS = (
    PlaneI8GemvConfig(4, 4),
    PlaneI8GemvConfig(8, 8),
    PlaneI8GemvConfig(2, 2),
    PlaneI8GemvConfig(8, 4),
)


# The int8 dots tried, their block_m (16 here) replaced by the activations' rows in one tile: up to 16 rows, and
# past them (64 columns with 8 warps or 32 with 4: 64x64 with 4 warps, or 64x128, spills registers in the sm_90
# build); ``halves`` and ``weight_rows_first`` are loop shapes to measure beside the others (not timed yet)
I8_FEW_ROWS_DOTS = (
    PlaneI8DotConfig(16, 64, 4, 3),
    PlaneI8DotConfig(16, 128, 8, 3),
    PlaneI8DotConfig(16, 64, 4, 3, split=4),
    PlaneI8DotConfig(16, 128, 8, 3, split=4),
    PlaneI8DotConfig(16, 64, 4, 3, halves=2),
    PlaneI8DotConfig(16, 64, 4, 3, split=4, weight_rows_first=True),
)
I8_MANY_ROWS_DOTS = (
    PlaneI8DotConfig(16, 64, 8, 3),
    PlaneI8DotConfig(16, 64, 8, 3, split=2),
    PlaneI8DotConfig(16, 64, 8, 3, split=4),
    PlaneI8DotConfig(16, 32, 4, 3),
    PlaneI8DotConfig(16, 32, 4, 3, split=2),
    PlaneI8DotConfig(16, 64, 8, 3, weight_rows_first=True),
)


def plane_candidates(
    layout: PlaneLayout, rows: int, int8_activations: bool = True, int8_tensor_cores: bool = True
) -> tuple[Tile, ...]:
    """The tiles tried for ``rows`` rows (:func:`measured_rows`) of a weight in planes: for one row the GEMVs
    of :data:`ONE_ROW_PLANE_TILES` and the int8 GEMVs (:data:`I8_ONE_ROW_GEMVS`), past it :func:`dot_candidates`,
    the int8 dots (:data:`I8_FEW_ROWS_DOTS`, :data:`I8_MANY_ROWS_DOTS`) and the dequantized weight. The int8
    kernels round the activations to 8 bits: none without ``int8_activations`` (fp32 activations keep their
    precision); with them, from 64 rows no bf16 dot (on the H100 the int8 dot or the dequantized weight won every
    Llama-3.1-8B shape and type there). The int8 dots need ``int8_tensor_cores`` (SM80 on: Triton compiles no
    integer dot for SM70 and SM75)."""
    if rows == 1:
        return ONE_ROW_PLANE_TILES + (I8_ONE_ROW_GEMVS if int8_activations else ())
    i8_tiles = (I8_FEW_ROWS_DOTS if rows <= 16 else I8_MANY_ROWS_DOTS) if int8_activations else ()
    i8_tiles = i8_tiles if int8_tensor_cores else ()
    i8 = tuple(replace(tile, block_m=max(16, rows)) for tile in i8_tiles)
    dots = dot_candidates(rows, PlaneDotConfig, 1) if rows < 64 or not i8 else ()
    return (*dots, *i8, DEQUANTIZED)


def measured_rows(rows: int) -> int:
    """The row count a measurement stands for: 1, 16 for 2 to 16 (every candidate's tile there is 16 rows, its time
    the same for any of them), past that the power of two above."""
    return 1 if rows == 1 else max(16, 1 << (rows - 1).bit_length())


class MeasuredTiles:
    """The fastest of the candidate tiles per (format, weight shape, row count (:func:`measured_rows`),
    dtype), measured once (``timer`` over ``copies`` of the weight that overflow the L2), or taken from
    ``cache`` where an earlier start measured it: the file's blocks' (:func:`candidates`, run by
    ``linear_rows``), or with ``planes`` the planes' (:func:`plane_candidates`, run by ``plane_rows``)."""

    def __init__(
        self,
        timer: Timer = graph_time,
        copies: Callable[[Tensor], list[Tensor]] = l2_overflowing_copies,
        planes: bool = False,
        cache: TileCache | None = None,
    ):
        self.timer, self.copies, self.planes, self.cache = timer, copies, planes, cache
        self.run: Run = plane_rows if planes else linear_rows
        self.choice: dict[tuple, Tile] = {}

    def __call__(self, x: Tensor, packed: Tensor, fmt_name: str, bias: Tensor | None) -> Tile:
        rows = measured_rows(x.shape[0])
        key = (fmt_name, rows, tuple(packed.shape), x.shape[1], x.dtype, bias is not None, x.device)
        if key not in self.choice:
            if (
                x.is_cuda and torch.cuda.is_current_stream_capturing()
            ):  # not measured: the capture's warm-up did not see it
                return self.default(fmt_name, rows, x.shape[1])
            tiles = self.candidates(fmt_name, rows, x)
            self.choice[key] = remembered(self.cache, x.device, ("planes" if self.planes else "blocks", *key[:-1]),
                                          tiles, lambda: self.fastest(x, packed, fmt_name, bias, tiles))  # fmt: skip
        return self.choice[key]

    def candidates(self, fmt_name: str, rows: int, x: Tensor) -> tuple[Tile, ...]:
        if self.planes:
            int8_tensor_cores = not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (8, 0)
            return plane_candidates(LAYOUTS[fmt_name], rows, x.dtype != torch.float32, int8_tensor_cores)
        return candidates(FORMATS[fmt_name], rows)

    def default(self, fmt_name: str, rows: int, k: int) -> Tile:
        if self.planes:
            return default_plane_gemv(rows, k, LAYOUTS[fmt_name]) if rows == 1 else default_plane_dot(rows)
        return default_gemv(FORMATS[fmt_name]) if rows == 1 else default_dot(FORMATS[fmt_name], rows)

    def fastest(self, x: Tensor, packed: Tensor, fmt_name: str, bias: Tensor | None, tiles: tuple[Tile, ...]) -> Tile:
        try:
            copies = self.copies(packed)
            calls = {tile: lambda w, t=tile: self.run(x, w, fmt_name, bias, t) for tile in tiles}
            times = time_each(self.timer, calls, copies, x.device)
        except torch.OutOfMemoryError as error:
            raise NotMeasured(tiles[0]) from error
        if not times:
            return tiles[0]
        best = min(times, key=times.__getitem__)
        log.debug("%s linear of %d rows over %s: %s %.1f us (first tile %.1f us)", fmt_name, x.shape[0],
                  tuple(packed.shape), best, times[best] * 1e6, times.get(tiles[0], math.nan) * 1e6)  # fmt: skip
        return best


class GgufKernels(WeightKernels):
    def __init__(self) -> None:
        self.tiles = MeasuredTiles(cache=TILE_CACHE)  # one per process: engines reuse its measurements

    def prepare(self, weight: QuantizedTensor) -> QuantizedTensor:
        """A linear's weight of a type that has planes, in them (others as they are)."""
        layout = LAYOUTS.get(ggml_type(weight))
        if layout is None or len(weight.logical_shape) != 2 or not layout.fits(weight.logical_shape[1]):
            return weight
        n, k = weight.logical_shape
        return QuantizedTensor(to_planes(weight.raw, layout), GgufPlanes(weight.format, n, k), (n, k))

    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None = None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        fmt = ggml_type(weight)
        tile = self.tiles(rows, weight.raw, fmt, bias) if rows.is_cuda and 0 < rows.shape[0] <= MEASURED_ROWS else None
        y = linear_rows(rows, weight.raw, fmt, bias, tile)
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
            act_and_mul = ops.act_and_mul_of(ops.current(), activation)
            return quant_moe.expert_by_expert(x, w13.raw, w2.raw, ggml_type(w13), topk_weights, topk_ids, act_and_mul)
        return quant_moe.fused_moe(x, w13.raw, w2.raw, ggml_type(w13), topk_weights, topk_ids, activation)


class GgufPlanes(WeightFormat):
    """A GGUF weight [rows, cols] in planes (:mod:`xinfer_cuda.kernels.gguf_planes`), 1-D bytes."""

    kernels = {"cuda": "xinfer_cuda.quant_weights:PLANE_KERNELS"}

    def __init__(self, source: WeightFormat, rows: int, cols: int):
        self.name = f"{source.name}:cuda-planes"
        self.source, self.layout = source, LAYOUTS[source.name.upper()]
        self.rows, self.cols = rows, cols
        self.block_values, self.block_bytes = source.block_values, source.block_bytes

    def dequantize(self, raw: Tensor) -> Tensor:
        return self.source.dequantize(from_planes(raw, self.layout, self.rows, self.cols))

    def dequantize_rows(self, raw: Tensor, index: Tensor) -> Tensor:
        return self.dequantize(raw)[index]


class PlaneKernels(WeightKernels):
    def __init__(self) -> None:
        self.tiles = MeasuredTiles(planes=True, cache=TILE_CACHE)

    def linear(self, x: Tensor, weight: QuantizedTensor, bias: Tensor | None = None) -> Tensor:
        fmt = weight.format
        assert isinstance(fmt, GgufPlanes)
        rows, name = x.reshape(-1, x.shape[-1]), fmt.layout.name
        if rows.shape[0] > MEASURED_ROWS:
            y = F.linear(rows, plane_dequantize(weight.raw, name, fmt.rows, fmt.cols, rows.dtype), bias)
        else:
            tile = self.tiles(rows, weight.raw, name, bias) if rows.is_cuda and rows.shape[0] else None
            y = plane_rows(rows, weight.raw, name, bias, tile)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def norm_linear(self, x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                    weight: QuantizedTensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """:meth:`xinfer.ops.Ops.norm_linear`: where one row's measured tile is the int8 GEMV, the norm's kernel
        also quantizes its output for it (one launch fewer than the norm, the quantization and the GEMV)."""
        fmt = weight.format
        assert isinstance(fmt, GgufPlanes)
        one_row = x.is_cuda and x.dim() == 2 and x.shape[0] == 1
        tile = self.tiles(x, weight.raw, fmt.layout.name, bias) if one_row else None
        quantized = quantized_blocks(1, fmt.cols, x.device) if isinstance(tile, PlaneI8GemvConfig) else None
        done = rms_norm(x, norm_weight, eps, residual, quantized=quantized, order=fmt.layout.fields)
        normed, h = (done, x) if residual is None else done
        if quantized is None:
            return self.linear(normed, weight, bias), normed, h
        return quantized_gemv(quantized, weight.raw, fmt.layout.name, fmt.rows, x.dtype, bias, tile), normed, h


GGUF_KERNELS = GgufKernels()
PLANE_KERNELS = PlaneKernels()
WEIGHT_KERNELS = {name.lower(): "xinfer_cuda.quant_weights:GGUF_KERNELS" for name in FORMATS}
WEIGHT_KERNELS["fp8"] = "xinfer_cuda.fp8_tensor_cores:FP8_KERNELS"  # and the tensor cores where selected
