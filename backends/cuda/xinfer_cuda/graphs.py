"""Engine steps, forward and sampling, as CUDA graph replays: decode steps and steps
with prompt tokens.

Kernel launches cost about a quarter of a millisecond on the benchmark machine (a
VM), and a step is hundreds of them: run eagerly, a step with prompt tokens (prefill,
chunked prefill, or decodes mixed with a new prompt's chunk, as continuous batching
makes most steps) pays ~90 ms in launches alone. So every step is one replay, padded
up to a captured shape (:mod:`xinfer_cuda.static_step`): decode batches for a ladder
of sizes (the split-K decode kernel; small ones twice, with block tables for short
contexts too, whose few splits merge without the reduce launch), and steps with prompt
tokens for a ladder of
token counts up to the step budget, four per octave (the prefill kernel, whose grid
depends only on the token and sequence counts, beside the decode kernel for their
one-query sequences). Before a replay come only the input copies.

Graphs are captured largest first in one memory pool, so the smaller ones reuse the
largest one's activations; the pool holds about one step of ``max_num_tokens``.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from xinfer.ops import DeviceTokens, HostBatch, StepForward, StepLimits
from xinfer.sampling import SampledRow
from xinfer_cuda.static_step import Bucket, StaticStep, pick_bucket, step_buckets

log = logging.getLogger("xinfer")


class StepGraphs:
    def __init__(self, forward: StepForward, limits: StepLimits, device: torch.device):
        self.step = StaticStep(forward, limits, device)
        self.buckets = step_buckets(limits)
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, Tensor]] = {}  # and the tokens it draws
        start, before = time.perf_counter(), torch.cuda.memory_allocated(device)
        pool = torch.cuda.graph_pool_handle()
        with no_garbage_collection():
            for bucket in sorted(self.buckets, key=lambda b: (b.num_tokens, b.decode), reverse=True):
                self.step.run(bucket)  # warm-up: Triton compiles (and the logits buffer is allocated) outside capture
                self.step.sample(bucket)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.step.run(bucket)
                    tokens = self.step.sample(bucket)
                self.graphs[bucket] = graph, tokens
        torch.cuda.synchronize(device)
        log.info(
            "CUDA graphs for decode batches of %s sequences and steps of %s tokens: captured in %.1f s, %.2f GiB",
            [b.num_seqs for b in self.buckets if b.decode], [b.num_tokens for b in self.buckets if not b.decode],
            time.perf_counter() - start, (torch.cuda.memory_allocated(device) - before) / 2**30,
        )  # fmt: skip

    def __call__(
        self, batch: HostBatch, pending: DeviceTokens | None = None, sampling: list[SampledRow] = ()
    ) -> tuple[Tensor, Tensor] | None:
        """Logits [len(sample_rows), vocab] of ``batch`` and the tokens drawn from them
        for ``sampling``, or None when no graph fits. Both are the graphs' buffers: the
        next replay overwrites them."""
        bucket = pick_bucket(self.buckets, batch)
        if bucket is None or not self.step.fits(batch):
            return None
        self.step.load(batch, bucket, pending, sampling)
        graph, tokens = self.graphs[bucket]
        graph.replay()
        rows = len(batch.sample_rows)
        return self.step.logits[:rows], tokens[:rows]


@contextmanager
def no_garbage_collection() -> Iterator[None]:
    """Collect first, then not at all: the collector destroying an earlier engine's
    graphs inside a capture invalidates the capture (CUDA forbids it)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
