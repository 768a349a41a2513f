"""Which kernel runs a one-row linear (batch-1 decode): cuBLAS, or the GEMV kernel in
one of its tile shapes, measured per weight shape on this GPU when the shape first
comes up outside a CUDA graph capture (the step graphs' warm-up run).

Batch-1 decode streams every weight once per token, so the bandwidth these kernels
reach is the tokens per second. Each candidate is timed as a CUDA graph of calls over
copies of the weight that overflow the L2 twice (eager launches on a VM take longer
than the kernel), and cuBLAS is kept unless a GEMV tile beats it by ``MARGIN``.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from xinfer_cuda.kernels.gemv import GemvConfig, gemv

log = logging.getLogger("xinfer")

CANDIDATES = (
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
MARGIN = 0.97  # a GEMV must take under 97 % of cuBLAS's time to replace it
MIN_CALLS = 16  # calls per timed graph

Call = Callable[[Tensor], object]  # one linear over the given weight
Timer = Callable[[Call, list[Tensor]], float]  # seconds per call, over those weights


def graph_time(call: Call, weights: list[Tensor]) -> float:
    """Seconds per ``call``, the best of three replays of a graph of calls cycling over
    ``weights``."""
    for w in weights:  # compiles, and cuBLAS's workspace, before the capture
        call(w)
    torch.cuda.synchronize()
    rounds = math.ceil(MIN_CALLS / len(weights))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for w in weights:
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
    return best / (rounds * len(weights))


def l2_overflowing_copies(weight: Tensor) -> list[Tensor]:
    """``weight`` and enough copies of it to hold twice the L2 (none for large weights)."""
    l2 = torch.cuda.get_device_properties(weight.device).L2_cache_size
    count = math.ceil(2 * l2 / (weight.numel() * weight.element_size()))
    return [weight] + [weight.clone() for _ in range(count - 1)]


class OneRowLinear:
    """``x @ weight.T + bias`` for one row of ``x``, by the kernel measured fastest for
    the weight's shape (``choice``: None for cuBLAS)."""

    def __init__(self, timer: Timer = graph_time, copies: Callable[[Tensor], list[Tensor]] = l2_overflowing_copies):
        self.timer = timer
        self.copies = copies
        self.choice: dict[tuple, GemvConfig | None] = {}

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        key = (tuple(weight.shape), weight.stride(), weight.dtype, bias is not None)
        if key not in self.choice:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return F.linear(x, weight, bias)  # not measured: the capture's warm-up did not see it
            self.choice[key] = self.fastest(x, weight, bias)
        config = self.choice[key]
        return F.linear(x, weight, bias) if config is None else gemv(x, weight, bias, config)

    def fastest(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> GemvConfig | None:
        if weight.stride(1) != 1:
            return None
        try:
            weights = self.copies(weight)
        except torch.OutOfMemoryError:
            return None
        cublas = self.timer(lambda w: F.linear(x, w, bias), weights)
        times = {c: self.timer(lambda w, c=c: gemv(x, w, bias, c), weights) for c in CANDIDATES}
        best = min(times, key=times.__getitem__)
        log.debug("one-row linear %s: cuBLAS %.1f us, GEMV %s %.1f us", tuple(weight.shape), cublas * 1e6, best,
                  times[best] * 1e6)  # fmt: skip
        return best if times[best] < MARGIN * cublas else None
