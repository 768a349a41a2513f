"""A multi-head latent attention shape on dummy weights (Moonlight-16B-A3B: DeepSeek-V3's architecture at
DeepSeek-V2-Lite's size; benchmarks/shapes.py states its config): batch-1 decode against its bandwidth limit,
and the KV cache's capacity in tokens at the same memory, the latent cache against the MHA-expanded one.
One JSON line.

The limit is the copy bandwidth (benchmarks/bandwidth.py) over the bytes a decode step reads per token
(:func:`decode_bytes_per_token`): per layer the query projection (or q-LoRA's two and its norm), the latent
projection and norm, ``kv_b_proj``, ``o_proj`` and the layer's two norms, and the latent cache at the mean
context length; the MLP as benchmarks/moe.py counts it (the dense first layers whole, then the router in
fp32, the active and shared experts); the embedding row, the final norm and the LM head.

Capacity: per token and layer the latent cache holds ``kv_lora_rank + qk_rope_head_dim`` values, the
expanded MHA form each head's key (``qk_nope_head_dim + qk_rope_head_dim``) and value (``v_head_dim``).

    python benchmarks/mla.py [--input-len 128] [--output-len 256] [--kv-gib 100]
    python benchmarks/mla.py --smoke   # checks the script on the CPU (a tiny DeepSeek-V3 shape, fp32)

Moonlight-16B-A3B, one bf16 decode step at context 0 (h = 2048, 16 heads, N 128, P 64, V 128, R 512, no
q-LoRA; 64 experts of 1408, 6 active and 2 shared; a dense first layer of 11264; vocabulary 163840)::

    attention  2 x (2048 x 16 x 192 + 2048 x 576 + 512 + 16 x 256 x 512 + 16 x 128 x 2048 + 2 x 2048)
                                                                                   =    27,534,336 per layer
    dense MLP  2 x 3 x 2048 x 11264                                                =   138,412,032 (layer 0)
    MoE        2 x 8 x 3 x 2048 x 1408 + 4 x (64 x 2048 + 64)                      =   138,936,576 per layer
    ends       2 x (2048 + 2048 + 163840 x 2048)                                   =   671,096,832
    total      27 x 27,534,336 + 138,412,032 + 26 x 138,936,576 + 671,096,832      = 5,165,286,912
"""

from __future__ import annotations

import argparse
import json

from moe import decode_against_limit
from shapes import SHAPES
from transformers import PretrainedConfig

SHAPE, SMOKE_SHAPE = "moonlight-16b-a3b", "deepseek-v3-tiny"
GiB = 1 << 30


def latent_values_per_token(config: PretrainedConfig) -> int:
    """Values the latent cache holds per token and layer: the latent and the rope key."""
    return config.kv_lora_rank + config.qk_rope_head_dim


def expanded_values_per_token(config: PretrainedConfig) -> int:
    """Values the expanded MHA form would hold per token and layer: every head's key and value."""
    head_k, head_v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    return config.num_attention_heads * (head_k + head_v)


def decode_bytes_per_token(config: PretrainedConfig, context_len: float, itemsize: int = 2) -> float:
    """Bytes one decode step of one sequence at ``context_len`` reads, weights and cache at ``itemsize``."""
    h, heads, layers = config.hidden_size, config.num_attention_heads, config.num_hidden_layers
    rank, rope, nope, v = config.kv_lora_rank, config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    q_size = heads * (nope + rope)
    q_lora = config.q_lora_rank
    query = h * q_lora + q_lora + q_lora * q_size if q_lora else h * q_size
    attention = query + h * (rank + rope) + rank + heads * (nope + v) * rank + heads * v * h + 2 * h
    cache = context_len * latent_values_per_token(config)
    dense = config.first_k_dense_replace
    experts = config.num_experts_per_tok + config.n_shared_experts
    moe = experts * 3 * h * config.moe_intermediate_size
    router = 4 * (config.n_routed_experts * h + config.n_routed_experts)  # weight and correction bias in fp32
    ends = h + h + config.vocab_size * h
    mlps = dense * 3 * h * config.intermediate_size + (layers - dense) * moe
    return itemsize * (layers * (attention + cache) + mlps + ends) + (layers - dense) * router


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--kv-gib", type=float, default=100.0, help="the cache memory the capacities are given at")
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on the CPU: a tiny DeepSeek-V3 shape, fp32, short runs"
    )
    args = parser.parse_args()
    shape, itemsize = (SMOKE_SHAPE, 4) if args.smoke else (SHAPE, 2)
    result = decode_against_limit(shape, args.smoke, args.input_len, args.output_len, decode_bytes_per_token)
    config = SHAPES[shape]()
    token_bytes = {
        "latent": config.num_hidden_layers * latent_values_per_token(config) * itemsize,
        "mha_expanded": config.num_hidden_layers * expanded_values_per_token(config) * itemsize,
    }
    result |= {
        "kv_bytes_per_token": token_bytes,
        "kv_capacity_tokens": {kind: int(args.kv_gib * GiB // size) for kind, size in token_bytes.items()},
        "kv_gib": args.kv_gib,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
