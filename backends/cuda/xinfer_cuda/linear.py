"""Which kernel runs a linear over a few rows (decode steps of small batches): cuBLAS,
or a kernel of :mod:`xinfer_cuda.kernels.gemv` in one of its tile shapes, measured per
weight shape and row count (rounded up to a power of two) on this GPU when they first
come up outside a CUDA graph capture (the step graphs' warm-up runs).

Such steps stream every weight once, so the bandwidth these kernels reach is the
tokens per second. Each candidate is timed as a CUDA graph of calls over copies of
the weight that overflow the L2 twice (eager launches on a VM take longer than the
kernel), and cuBLAS is kept unless a tile beats it by ``MARGIN``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor
from triton.runtime.errors import OutOfResources

from xinfer_cuda.kernels.gemv import MAX_ROWS, DotConfig, GemvConfig, gemv
from xinfer_cuda.kernels.norm_linear import norm_linear, norm_route
from xinfer_cuda.tile_cache import NotMeasured, TileCache, remembered

if TYPE_CHECKING:
    from xinfer.layers.moe import Routing

log = logging.getLogger("xinfer")

ONE_ROW_TILES = (
    GemvConfig(4, 1024, 4),
    GemvConfig(8, 1024, 8),
    GemvConfig(8, 512, 4),
    GemvConfig(16, 512, 8),
    GemvConfig(16, 256, 4),
    GemvConfig(32, 256, 8),
    GemvConfig(4, 1024, 4, unroll=2),
    GemvConfig(8, 512, 4, unroll=2),
    GemvConfig(16, 256, 4, unroll=2),
    GemvConfig(8, 512, 4, unroll=4),
    GemvConfig(16, 256, 4, unroll=4),
)
# the norm fused into the linear in one pass over K (kernels/norm_linear.py), for weights in x's dtype
ONE_PASS_TILES = tuple(
    replace(tile, one_pass=True)
    for tile in ONE_ROW_TILES
    if (tile.block_n, tile.block_k, tile.unroll) in {(4, 1024, 1), (8, 512, 1), (16, 256, 1), (32, 256, 1),
                                                      (8, 512, 2), (16, 256, 2)}
)  # fmt: skip
DOT_TILES = (
    DotConfig(16, 256, 4, 4),
    DotConfig(16, 512, 4, 3),
    DotConfig(32, 128, 4, 4),
    DotConfig(32, 256, 4, 3),
    DotConfig(64, 64, 4, 6),
    DotConfig(64, 128, 4, 4),
)
Tile = GemvConfig | DotConfig
MARGIN = 0.97  # a tile must take under 97 % of cuBLAS's time to replace it
MIN_CALLS = 16  # calls per timed graph
MAX_COPIES = 32  # of a small weight: past that the model's weights would fit in the L2 anyway

T = TypeVar("T")
K = TypeVar("K")
Call = Callable[[Tensor], object]  # one linear over the given weight
Timer = Callable[[Call, list[Tensor]], float]  # seconds per call, over those weights


def graph_time(call: Callable[[T], object], inputs: Sequence[T]) -> float:
    """Seconds per ``call``, the best of three replays of a graph of calls cycling over
    ``inputs`` (a linear's weight copies, or calls themselves)."""
    for w in inputs:  # compiles, and cuBLAS's workspace, before the capture
        call(w)
    torch.cuda.synchronize()
    rounds = math.ceil(MIN_CALLS / len(inputs))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for w in inputs:
                call(w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = math.inf
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best / (rounds * len(inputs))


def time_each(timer: Callable[[Callable[[T], object], Sequence[T]], float], calls: Mapping[K, Callable[[T], object]],
              inputs: Sequence[T], device: torch.device) -> dict[K, float]:  # fmt: skip
    """Seconds per call of each of ``calls`` over ``inputs`` by ``timer``, leaving out those that need
    more shared memory or registers than this GPU has. On a GPU each call first runs once beside
    the others, in threads: Triton compiles a kernel mostly with the GIL released, so a first
    start's compiles of every candidate tile overlap (timed one after the other, they would not)."""
    if device.type == "cuda" and len(calls) > 1:
        run_side_by_side([lambda call=call: call(inputs[0]) for call in calls.values()], device)
    times = {}
    for key, call in calls.items():
        try:
            times[key] = timer(call, inputs)
        except OutOfResources:
            continue
    return times


def run_side_by_side(calls: Sequence[Callable[[], object]], device: torch.device) -> None:
    """Each of ``calls`` once, in threads on the caller's stream."""
    stream = torch.cuda.current_stream(device)

    def run(call: Callable[[], object]) -> None:
        # (grad mode is per thread; what a call raises, the caller's own run of it raises again)
        with (
            torch.inference_mode(),
            torch.cuda.device(device),
            torch.cuda.stream(stream),
            contextlib.suppress(Exception),
        ):
            call()

    with ThreadPoolExecutor(min(len(calls), os.cpu_count() or 1)) as pool:
        list(pool.map(run, calls))
    torch.cuda.synchronize(device)


def l2_overflowing_copies(weight: Tensor) -> list[Tensor]:
    """``weight`` and enough copies of it to hold twice the L2 (none for large weights,
    at most ``MAX_COPIES`` for small ones)."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    count = min(math.ceil(2 * l2 / (weight.numel() * weight.element_size())), MAX_COPIES)
    return [weight] + [weight.clone() for _ in range(count - 1)]


def _pow2(rows: int) -> int:
    return 1 << (rows - 1).bit_length()


def candidates(rows: int, tensor_cores: bool = True) -> tuple[Tile, ...]:
    """The tiles tried for ``rows`` rows; without tensor cores (before sm_80) dots run on
    the FMA units and spill: none of them."""
    dots = DOT_TILES if tensor_cores else ()
    return ONE_ROW_TILES + dots if rows == 1 else dots


class SmallBatchLinear:
    """``x @ weight.T + bias`` for up to :data:`MAX_ROWS` rows of ``x`` by the kernel
    measured fastest for the weight's shape and the row count (``choice``: None for
    cuBLAS); and a norm fused into that linear (:meth:`norm_linear`), measured against
    the norm's kernel followed by the linear (``choice``: None for those two)."""

    def __init__(self, timer: Timer = graph_time, copies: Callable[[Tensor], list[Tensor]] = l2_overflowing_copies,
                 cache: TileCache | None = None):  # fmt: skip
        self.timer = timer
        self.copies = copies
        self.cache = cache  # earlier starts' choices
        self.choice: dict[tuple, Tile | None] = {}
        self.measuring_s = 0.0  # since the last report
        self.reported = 0  # choices in the last report

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        key = (_pow2(x.shape[0]), tuple(weight.shape), weight.stride(), weight.dtype, bias is not None, x.device)
        tile = self._tile(key, x, weight, lambda w: F.linear(x, w, bias), lambda t: lambda w: gemv(x, w, bias, t))
        return F.linear(x, weight, bias) if tile is None else gemv(x, weight, bias, tile)

    def norm_linear(
        self,
        x: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight: Tensor,
        bias: Tensor | None,
        unfused: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]],
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`xinfer.ops.Ops.norm_linear` by the fused kernel in the tile measured
        fastest, or by ``unfused(weight)`` (the norm's kernel, then this linear) where
        that was faster."""
        key = ("norm", _pow2(x.shape[0]), tuple(weight.shape), weight.stride(), weight.dtype, bias is not None,
               residual is not None, x.device)  # fmt: skip

        def fused(tile: Tile) -> Call:
            return lambda w: norm_linear(x, residual, norm_weight, eps, w, bias, tile)

        one_pass = ONE_PASS_TILES if x.shape[0] == 1 and weight.dtype == x.dtype else ()
        tile = self._tile(key, x, weight, unfused, fused, more=one_pass)
        return unfused(weight) if tile is None else norm_linear(x, residual, norm_weight, eps, weight, bias, tile)

    def norm_route(
        self,
        x: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight: Tensor,
        routing: Routing,
        correction_bias: Tensor | None,
        unfused: Callable[[Tensor], tuple[Tensor, Tensor, Tensor, Tensor]],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`xinfer.ops.Ops.norm_route` of one row by the one-launch kernel in the tile
        measured fastest, or by ``unfused(weight)`` (the norm-and-linear op, then the
        routing's) where that was faster."""
        key = ("route", tuple(weight.shape), weight.stride(), weight.dtype, residual is not None, routing,
               correction_bias is not None, x.device)  # fmt: skip

        def fused(tile: Tile) -> Call:
            assert isinstance(tile, GemvConfig)
            return lambda w: norm_route(x, residual, norm_weight, eps, w, routing, correction_bias, tile)

        one_pass = ONE_PASS_TILES if weight.dtype == x.dtype else ()
        tile = self._tile(key, x, weight, unfused, fused, ONE_ROW_TILES + one_pass)
        routed = None if tile is None else fused(tile)(weight)
        return unfused(weight) if routed is None else routed  # type: ignore[return-value]

    def _tile(
        self,
        key: tuple,
        x: Tensor,
        weight: Tensor,
        baseline: Call,
        tile_call: Callable[[Tile], Call],
        tiles: tuple[Tile, ...] | None = None,
        more: tuple[Tile, ...] = (),
    ) -> Tile | None:
        """The tile chosen for ``key`` (measured on its first call) among ``tiles`` (by default
        the :func:`candidates` for the row count) and ``more``, None for the baseline (also
        inside a capture whose warm-up did not see the key)."""
        if key not in self.choice:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return None  # not measured: the capture's warm-up did not see it
            tensor_cores = not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (8, 0)
            start = time.perf_counter()
            tiles = (candidates(_pow2(x.shape[0]), tensor_cores) if tiles is None else tiles) + more
            self.choice[key] = remembered(self.cache, x.device, ("linear", *key[:-1]), (*tiles, None),
                                          lambda: self.fastest(key, weight, baseline, tile_call, tiles))  # fmt: skip
            self.measuring_s += time.perf_counter() - start
        return self.choice[key]

    def fastest(
        self, key: tuple, weight: Tensor, baseline: Call, tile_call: Callable[[Tile], Call], tiles: tuple[Tile, ...]
    ) -> Tile | None:
        if not tiles or weight.stride(1) != 1:
            return None
        try:  # the copies and the timed graphs need memory a full KV pool may have taken (eager steps)
            weights = self.copies(weight)
            base = self.timer(baseline, weights)
            times = time_each(self.timer, {tile: tile_call(tile) for tile in tiles}, weights, weight.device)
        except torch.OutOfMemoryError as error:
            raise NotMeasured(None) from error
        if not times:
            return None
        best = min(times, key=times.__getitem__)
        log.debug("%s rows over %s: baseline %.1f us, %s %.1f us", key, tuple(weight.shape), base * 1e6, best,
                  times[best] * 1e6)  # fmt: skip
        return best if times[best] < MARGIN * base else None

    def report(self) -> str | None:
        """A line on the choices made since the last report, None if there were none."""
        items = list(self.choice.items())[self.reported :]
        if not items:
            return None
        new = [tile for key, tile in items if not isinstance(key[0], str)]
        norms = [tile for key, tile in items if key[0] == "norm"]
        routes = [tile for key, tile in items if key[0] == "route"]
        own = sum(tile is not None for tile in new)
        line = (f"linears of up to {MAX_ROWS} rows: measured {len(new)} (row count, weight shape) pairs in "
                f"{self.measuring_s:.1f} s; own kernels for {own}, cuBLAS for {len(new) - own}")  # fmt: skip
        if norms:
            fused = sum(tile is not None for tile in norms)
            line += f"; the norm fused into the linear for {fused} of {len(norms)} (norm, linear) pairs"
        if routes:
            fused = sum(tile is not None for tile in routes)
            line += f"; norm, router and routing in one launch for {fused} of {len(routes)} routers"
        self.reported, self.measuring_s = len(self.choice), 0.0
        return line
