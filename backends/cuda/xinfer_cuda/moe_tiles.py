"""Which tiles the fused-MoE op runs a small decode batch with (the per-slot path of
:mod:`xinfer_cuda.kernels.moe`): the heuristic :func:`~xinfer_cuda.kernels.moe.slot_tiles`
or one of :func:`~xinfer_cuda.kernels.moe.slot_candidates`, measured per expert shape and
token count on this GPU when they first come up outside a CUDA graph capture (the step
graphs' warm-up runs), as :mod:`xinfer_cuda.linear` measures the linears.

A batch-1 step reads only its k experts' weights (Qwen3-30B-A3B: 75 MB a layer, ~18 µs
at 4.2 TB/s), so the bytes in flight and each launch's ramp and tail decide the time,
and the best tiles move with the GPU and the shape. Each candidate is timed as a CUDA
graph of calls over routings of their own to random experts (consecutive calls read
other experts' weights, as consecutive layers do); the heuristic's tiles stay unless a
candidate beats them by ``MARGIN``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from xinfer_cuda.kernels import moe
from xinfer_cuda.kernels.moe import SlotTiles
from xinfer_cuda.linear import MARGIN, graph_time, time_each
from xinfer_cuda.tile_cache import NotMeasured, TileCache, remembered

log = logging.getLogger("xinfer")

ROUTINGS = 16  # calls per timed graph, each to experts of its own
Step = tuple[Tensor, Tensor, Tensor]  # x, routing weights, expert ids
Timer = Callable[[Callable[[Step], Any], Sequence[Step]], float]  # seconds per call, over those steps


def random_steps(x: Tensor, num_experts: int, top_k: int, count: int) -> list[Step]:
    """``count`` steps of ``x``'s shape, each token routed to ``top_k`` distinct random experts
    (a generator of its own: the process's random state is left alone)."""
    generator = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(count):
        ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(x.shape[0])])
        weights = torch.rand(x.shape[0], top_k, generator=generator) + 0.1
        inputs = torch.randn(x.shape, generator=generator)
        steps.append((inputs.to(x.device, x.dtype), (weights / weights.sum(-1, keepdim=True)).to(x.device),
                      ids.to(x.device, torch.int32)))  # fmt: skip
    return steps


class SmallBatchMoE:
    """The per-slot tiles for a step of a few tokens (``choice``: per key, None for the
    heuristic's), measured on the key's first call."""

    def __init__(self, timer: Timer = graph_time, routings: int = ROUTINGS, cache: TileCache | None = None):
        self.timer = timer
        self.routings = routings
        self.cache = cache  # earlier starts' choices
        self.choice: dict[tuple, SlotTiles | None] = {}
        self.measuring_s = 0.0  # since the last report
        self.reported = 0  # choices in the last report

    def tiles(self, x: Tensor, w13: Tensor, w2: Tensor, top_k: int, activation: str) -> SlotTiles:
        num_tokens = x.shape[0]
        default = moe.slot_tiles(num_tokens, top_k, x)
        key = (num_tokens, top_k, tuple(w13.shape), tuple(w2.shape), w13.dtype, activation, x.device)
        if key not in self.choice:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                return default  # not measured: the capture's warm-up did not see it
            start = time.perf_counter()
            candidates = moe.slot_candidates(num_tokens, top_k, x)
            self.choice[key] = remembered(self.cache, x.device, ("experts", *key[:-1]), (*candidates, None),
                                          lambda: self.fastest(x, w13, w2, top_k, activation, default, candidates))  # fmt: skip
            self.measuring_s += time.perf_counter() - start
        return self.choice[key] or default

    def fastest(
        self,
        x: Tensor,
        w13: Tensor,
        w2: Tensor,
        top_k: int,
        activation: str,
        default: SlotTiles,
        candidates: Sequence[SlotTiles],
    ) -> SlotTiles | None:
        if not candidates:
            return None

        def run(tiles: SlotTiles) -> Callable[[Step], Tensor]:
            return lambda step: moe.fused_moe(step[0], w13, w2, step[1], step[2], activation, tiles)

        try:  # the timed graphs need memory a full KV pool may have taken (eager steps)
            steps = random_steps(x, w2.shape[0], top_k, self.routings)
            base = self.timer(run(default), steps)
            times = time_each(self.timer, {tiles: run(tiles) for tiles in candidates}, steps, x.device)
        except torch.OutOfMemoryError as error:
            raise NotMeasured(None) from error
        if not times:
            return None
        best = min(times, key=times.__getitem__)
        log.debug("experts %s x %s, %d tokens: heuristic %.1f us, %s %.1f us", tuple(w13.shape), tuple(w2.shape),
                  x.shape[0], base * 1e6, best, times[best] * 1e6)  # fmt: skip
        return best if times[best] < MARGIN * base else None

    def report(self) -> str | None:
        """A line on the choices made since the last report, None if there were none."""
        items = list(self.choice.values())[self.reported :]
        if not items:
            return None
        measured = sum(tiles is not None for tiles in items)
        self.reported, seconds, self.measuring_s = len(self.choice), self.measuring_s, 0.0
        return (f"experts of small batches: measured {len(items)} (token count, shape) pairs in {seconds:.1f} s; "
                f"measured tiles for {measured}, the heuristic's for {len(items) - measured}")  # fmt: skip
