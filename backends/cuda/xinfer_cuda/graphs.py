"""Decode steps as CUDA graph replays.

Kernel launches cost about a quarter of a millisecond on the benchmark machine, so
a decode step (hundreds of launches) must be one replay. The forward of one token
per sequence is captured for a ladder of batch sizes; a batch is padded up to the
next size. Padding rows write no KV (slot -1) and read one block of context.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import Tensor

from xinfer.ops import AttentionMetadata

log = logging.getLogger("xinfer")
Forward = Callable[[Tensor, Tensor, AttentionMetadata], Tensor]


def batch_sizes(max_batch: int) -> list[int]:
    ladder = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in ladder if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, forward: Forward, max_batch: int, max_blocks_per_seq: int, max_seq_len: int, device: torch.device):
        self.sizes = batch_sizes(max_batch)
        self.max_seq_len = max_seq_len
        size = self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        start, before = time.perf_counter(), torch.cuda.memory_allocated(device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            forward(*self._inputs(bs))  # warm-up: Triton compiles and autotunes outside capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = forward(*self._inputs(bs))
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.capture_bytes = torch.cuda.memory_allocated(device) - before
        log.info(
            "decode CUDA graphs for batch sizes %s: captured in %.1f s, %.2f GiB",
            self.sizes, self.capture_seconds, self.capture_bytes / 2**30,
        )

    def _inputs(self, bs: int) -> tuple[Tensor, Tensor, AttentionMetadata]:
        meta = AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_seqlen_q=1,
            max_seq_len=self.max_seq_len,
        )
        return self.input_ids[:bs], self.positions[:bs], meta

    def __call__(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        """Logits [n, vocab] of a decode batch of ``n`` sequences, or None when no graph fits."""
        n = input_ids.shape[0]
        bs = next((s for s in self.sizes if s >= n), None)
        if bs is None or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:bs].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:bs].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
