"""DeepSeek-V4-Flash's layers on dummy weights (8 of its 43 layers: benchmarks/shapes.py states the config):
batch-1 decode against its bandwidth limit, and the cache's tokens per GiB at a 128k context against an
uncompressed multi-head latent attention cache. One JSON line.

The limit is the copy bandwidth (benchmarks/bandwidth.py) over the bytes a decode step reads per token
(:func:`decode_bytes_per_token`): per layer its attention's projections (q-LoRA, the key-value row, the
grouped output's two), norms and sinks, the two hyper-connections (fp32), the compressor's and indexer's
projections and position biases; the window's rows, the entries the step reads (HCA: all; CSA: the indexer's
keys, all of them, and the ``index_topk`` selected entries) and, amortised, the open windows' rows each
pooling reads; the MLP's router (its correction bias, or the token's row of the hash table), its active and
shared experts; the embedding row, the head's
hyper-connection, the final norm and the LM head.

Cache per token at context L: each layer's caches as xinfer allocates them (the model built on the meta
device, :class:`xinfer.cache.allocate.CacheLayout`), every pool holding what a sequence of L tokens keeps
there (a windowed pool only its window), over L; at a ``block_size`` of 16 (the default: an HCA entry then
takes a block's row of its own, 1 in 8 used) and 128 (no waste). The MLA cache against it: DeepSeek-V3's
latent and rope key (512 + 64 values) per token in as many layers.

    python benchmarks/deepseek_v4.py [--input-len 128] [--output-len 256] [--context 131072]
    python benchmarks/deepseek_v4.py --smoke   # checks the script on the CPU (a tiny V4 shape, fp32)

The torch references run V4's compressed ops (no Triton kernels yet) and the step runs without CUDA
graphs: the decode figure is a baseline, not the kernels' speed.
"""

from __future__ import annotations

import argparse
import json

import torch
from moe import decode_against_limit
from shapes import SHAPES
from transformers import PretrainedConfig

from xinfer.cache.allocate import CacheLayout
from xinfer.engine.memory_plan import blocks_kept
from xinfer.kv import get_format
from xinfer.loading.loader import build_model

SHAPE, SMOKE_SHAPE = "deepseek-v4-flash-8l", "deepseek-v4-tiny"
GiB = 1 << 30
MLA_VALUES = 512 + 64  # DeepSeek-V3's latent and rope key per token and layer


def decode_bytes_per_token(config: PretrainedConfig, context_len: float, itemsize: int = 2) -> float:
    """Bytes one decode step of one sequence at ``context_len`` reads, weights and cache at ``itemsize``."""
    h, heads, d, q_lora = config.hidden_size, config.num_attention_heads, config.head_dim, config.q_lora_rank
    streams, groups, rank = config.hc_mult, config.o_groups, config.o_lora_rank
    attention = h * q_lora + q_lora + q_lora * heads * d + h * d + d + heads * d * rank + groups * rank * h
    hyper = 4 * 2 * ((2 + streams) * streams * (streams * h + 1) + 3)  # fp32: fn, base, scale; two per layer
    mlp = (config.num_experts_per_tok + 1) * 3 * h * config.moe_intermediate_size + h * config.n_routed_experts
    total = 0.0
    for kind, mlp_kind in zip(config.layer_types, config.mlp_layer_types):
        weights = attention + 2 * h + mlp
        fp32 = 4 * heads + hyper  # sinks, the hyper-connections
        fp32 += 4 * config.n_routed_experts if mlp_kind == "moe" else 8 * config.num_experts_per_tok  # bias; table row
        cache = min(context_len, config.sliding_window) * d
        if kind != "sliding_attention":
            ratio = config.compress_rates[kind]
            overlap = 2 if kind == "compressed_sparse_attention" else 1
            weights += 2 * h * overlap * d + d
            fp32 += 4 * ratio * overlap * d
            if context_len:  # a window of overlap * ratio rows of 2 * overlap * d, every ratio steps
                cache += 2 * overlap * overlap * d
            entries = context_len / ratio
            if kind == "heavily_compressed_attention":
                cache += entries * d
            else:
                di, hi = config.index_head_dim, config.index_n_heads
                weights += 2 * h * 2 * di + di + q_lora * hi * di + h * hi
                fp32 += 4 * ratio * 2 * di
                cache += (2 * 2 * 2 * di if context_len else 0) + entries * di + min(entries, config.index_topk) * d
        total += itemsize * (weights + cache) + fp32
    ends = itemsize * (2 * h + config.vocab_size * h) + 4 * (streams * streams * h + streams + 1)
    return total + ends


def cache_bytes_per_token(config: PretrainedConfig, context_len: int, block_size: int, itemsize: int) -> float:
    """Bytes per token of one sequence's caches at ``context_len`` (the module's docstring)."""
    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
    layout = CacheLayout.of(build_model(config, torch.device("meta"), dtype))
    blocks = layout.block_bytes(block_size, get_format("auto"), dtype)
    kept = [blocks_kept(context_len, group.window, block_size) for group in layout.groups]
    return sum(b * n for b, n in zip(blocks, kept)) / context_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--context", type=int, default=131072, help="the context the cache's capacity is given at")
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on the CPU: a tiny V4 shape, fp32, short runs"
    )
    args = parser.parse_args()
    shape, itemsize = (SMOKE_SHAPE, 4) if args.smoke else (SHAPE, 2)
    context = 256 if args.smoke else args.context
    config = SHAPES[shape]()
    mla = config.num_hidden_layers * MLA_VALUES * itemsize
    per_token = {f"v4_block_{bs}": cache_bytes_per_token(config, context, bs, itemsize) for bs in (16, 128)}
    per_token["mla_uncompressed"] = mla
    result = {
        "cache_context": context,
        "cache_bytes_per_token": {kind: round(size, 2) for kind, size in per_token.items()},
        "cache_tokens_per_GiB": {kind: int(GiB // size) for kind, size in per_token.items()},
        "cache_tokens_vs_mla": {kind: round(mla / size, 2) for kind, size in per_token.items()},
    }
    result |= decode_against_limit(shape, args.smoke, args.input_len, args.output_len, decode_bytes_per_token)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
