"""Decode steps as CUDA graph replays.

Kernel launches cost about a quarter of a millisecond on the benchmark machine, so
a decode step (hundreds of launches) must be one replay, and what precedes it must
be few operations: a step's inputs travel in two host-to-device copies (one int64
and one int32 buffer, whose fixed slices the graph reads) and one scatter of the
block tables. The forward of one token per sequence is captured for a ladder of
batch sizes; a batch is padded up to the next size. Padding rows write no KV
(slot -1) and attend over one token of block 0.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import Tensor

from xinfer.ops import AttentionMetadata, HostBatch

log = logging.getLogger("xinfer")
Forward = Callable[[Tensor, Tensor, AttentionMetadata], Tensor]


def batch_sizes(max_batch: int) -> list[int]:
    ladder = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in ladder if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(
        self, forward: Forward, max_batch: int, max_blocks_per_seq: int, max_seq_len: int, device: torch.device
    ):
        self.sizes = batch_sizes(max_batch)
        self.max_seq_len = max_seq_len
        self.max_blocks = max_blocks_per_seq
        size = self.sizes[-1]
        # int64 buffer: input ids | positions | slots; int32 buffer: seq lens | tables (packed rows)
        self.host64 = torch.zeros(3 * size, dtype=torch.int64, pin_memory=True)
        self.host32 = torch.zeros(size + size * max_blocks_per_seq, dtype=torch.int32, pin_memory=True)
        self.dev64 = torch.zeros_like(self.host64, device=device)
        self.dev32 = torch.zeros_like(self.host32, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.dev64.view(3, size)
        self.seq_lens = self.dev32[:size]
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        start, before = time.perf_counter(), torch.cuda.memory_allocated(device)
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            forward(*self._inputs(bs))  # warm-up: Triton compiles outside capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = forward(*self._inputs(bs))
            self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        log.info(
            "decode CUDA graphs for batch sizes %s: captured in %.1f s, %.2f GiB",
            self.sizes, time.perf_counter() - start, (torch.cuda.memory_allocated(device) - before) / 2**30,
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

    def __call__(self, batch: HostBatch) -> Tensor | None:
        """Logits [n, vocab] of a decode batch of ``n`` sequences, or None when no graph fits."""
        n = len(batch.input_ids)
        bs = next((s for s in self.sizes if s >= n), None)
        width = max(len(row) for row in batch.block_tables)
        if bs is None or width > self.max_blocks:
            return None
        size = self.sizes[-1]
        ids, positions, slots = self.host64.view(3, size)
        ids[:n] = torch.tensor(batch.input_ids)
        positions[:n] = torch.tensor(batch.positions)
        slots[:n] = torch.tensor(batch.slot_mapping)
        slots[n:bs] = -1
        self.host32[:n] = torch.tensor(batch.seq_lens)
        self.host32[n:bs] = 1
        padded = [block for row in batch.block_tables for block in row + [0] * (width - len(row))]
        self.host32[size : size + n * width] = torch.tensor(padded, dtype=torch.int32)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32[: size + n * width].copy_(self.host32[: size + n * width], non_blocking=True)
        self.block_tables[:n, :width] = self.dev32[size : size + n * width].view(n, width)
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
