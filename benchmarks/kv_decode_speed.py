"""Decode attention time per KV format on the GPU (Llama-3.1-8B shape: 32 query heads,
8 KV heads, head_dim 128; one layer), and the bandwidth each achieves.

    python benchmarks/kv_decode_speed.py

Prints one JSON line per (batch, context, format): microseconds per call, bytes of
cache read, and GB/s.
"""

from __future__ import annotations

import json

import torch
import triton

from xinfer.kv import get_format
from xinfer.ops import AttentionMetadata
from xinfer_cuda.ops import CudaOps

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
CASES = [(1, 1024), (1, 32768), (64, 8192)]
FORMATS = ["auto", "fp8", "turbo8", "turbo4", "turbo3"]


def main() -> None:
    ops, device = CudaOps(), torch.device("cuda")
    for batch, context in CASES:
        blocks_per_seq = context // BLOCK_SIZE
        num_blocks = batch * blocks_per_seq
        tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(batch, blocks_per_seq)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
            block_tables=tables,
            slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
            max_seqlen_q=1,
            max_seq_len=context,
        )
        q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
        for name in FORMATS:
            fmt = get_format(name)
            cache = fmt.allocate(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.bfloat16, device)
            for start in range(0, num_blocks * BLOCK_SIZE, 1 << 20):  # fill in slices to bound memory
                slots = torch.arange(start, min(start + (1 << 20), num_blocks * BLOCK_SIZE), device=device)
                k = torch.randn(len(slots), KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
                ops.write_kv(k, k, cache, slots)
            ms = triton.testing.do_bench(lambda: ops.attention(q, cache, meta, HEAD_DIM**-0.5), warmup=25, rep=200)
            read = batch * context * KV_HEADS * fmt.bytes_per_token(HEAD_DIM, torch.bfloat16)
            print(json.dumps({
                "batch": batch, "context": context, "format": name, "us": round(ms * 1e3, 1),
                "cache_bytes": read, "GB/s": round(read / ms / 1e6, 1),
            }), flush=True)  # fmt: skip
            del cache


if __name__ == "__main__":
    main()
