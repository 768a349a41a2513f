"""A hybrid (Gated DeltaNet + attention) Qwen3.6 shape on dummy weights: batch-1 decode against
its bandwidth limit, and a throughput run. One JSON line.

The limit is the copy bandwidth (benchmarks/bandwidth.py) over the bytes a decode step moves
per token (:func:`decode_bytes_per_token`): the weights it reads — every layer's two norms;
a full-attention layer's q (query and output gate), k, v and o projections and q/k norms; a
DeltaNet layer's input projections (q, k, v, z, b, a), conv, ``A_log``, ``dt_bias``, output
norm and projection; the MLP, dense or the router, the ``num_experts_per_tok`` active experts,
the shared expert and its gate; the embedding row, the final norm and the LM head — then each
DeltaNet layer's recurrent state (fp32 conv window and delta-rule state), read and written,
and the attention layers' KV at the mean context length.

    python benchmarks/hybrid.py [--shape qwen3.6-35b-a3b] [--input-len 128] [--output-len 256]
    python benchmarks/hybrid.py --shape qwen3.6-27b
    python benchmarks/hybrid.py --max-model-len 4096 --skip-throughput   # batch 1 alone, on an 80 GB GPU
    python benchmarks/hybrid.py --smoke   # checks the script on the CPU (a tiny Qwen3.6-MoE shape, fp32)

Qwen3.6-35B-A3B's shape, one bf16 decode step at context 0 (h = 2048; 10 attention layers of
16 query and 2 KV heads of 256; 30 DeltaNet layers of 16 key and 32 value heads of 128, conv 4;
8 of 256 experts of 512 and a shared one; vocabulary 248320)::

    attention  2 x (2048 x 256 x (3 x 16 + 2 x 2) + 2 x 256)                        =      54,526,976 per layer
    DeltaNet   2 x (2048 x (8192 + 4096 + 2 x 32) + 8192 x 4 + 2 x 32 + 128 + 4096 x 2048)
                                                                                     =      67,436,928 per layer
    MoE        2 x (256 x 2048 + 8 x 3 x 2048 x 512 + 3 x 2048 x 512 + 2048)         =      57,675,776 per layer
    norms      2 x 2 x 2048                                                          =           8,192 per layer
    ends       2 x (2048 + 2048 + 248320 x 2048)                                     =   1,017,126,912
    weights    10 x 54,526,976 + 30 x 67,436,928 + 40 x (57,675,776 + 8,192) + ends  =   5,892,863,232
    state      2 x 30 x 4 x (8192 x 3 + 32 x 128 x 128)   (read and written)         =     131,727,360

so 6.02 GB per token at context 0, the state 2 % of it (Qwen3.6-27B: 51.2 GB of weights, 2 x 157 MB of
state).
"""

from __future__ import annotations

import argparse
import json

from moe import decode_against_limit, router_bytes, throughput
from shapes import SHAPES
from transformers import PretrainedConfig

SMOKE_SHAPE = "qwen3.6-moe-tiny"


def layer_counts(config: PretrainedConfig) -> tuple[int, int]:
    """(full-attention layers, Gated DeltaNet layers)."""
    deltanet = config.layer_types.count("linear_attention")
    return config.num_hidden_layers - deltanet, deltanet


def conv_channels(config: PretrainedConfig) -> int:
    return 2 * config.linear_num_key_heads * config.linear_key_head_dim + value_dim(config)


def value_dim(config: PretrainedConfig) -> int:
    return config.linear_num_value_heads * config.linear_value_head_dim


def weight_bytes(config: PretrainedConfig, itemsize: int = 2) -> int:
    """Bytes of weights one decode step of one sequence reads."""
    h, d, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    full, deltanet = layer_counts(config)
    heads, kv_heads, value_heads = config.num_attention_heads, config.num_key_value_heads, config.linear_num_value_heads
    attention = h * d * (3 * heads + 2 * kv_heads) + 2 * d  # q and its gate, o, k, v; q/k norms
    channels, kernel = conv_channels(config), config.linear_conv_kernel_dim
    linear_attention = (h * (channels + value_dim(config) + 2 * value_heads) + channels * kernel
                        + 2 * value_heads + config.linear_value_head_dim + value_dim(config) * h)  # fmt: skip
    if getattr(config, "num_experts", 0):
        experts = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
        mlp = experts + 3 * h * config.shared_expert_intermediate_size + h  # and the shared expert's gate
        router = router_bytes(config, itemsize)
    else:
        mlp, router = 3 * h * config.intermediate_size, 0
    norms = 2 * h
    ends = h + h + config.vocab_size * h  # the embedding row, the final norm, the LM head
    return (itemsize * (full * attention + deltanet * linear_attention + layers * (mlp + norms) + ends)
            + layers * router)  # fmt: skip


def state_bytes(config: PretrainedConfig) -> int:
    """Bytes of one sequence's recurrent state (fp32), over the DeltaNet layers."""
    _, deltanet = layer_counts(config)
    conv = conv_channels(config) * (config.linear_conv_kernel_dim - 1)
    delta_rule = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    return deltanet * 4 * (conv + delta_rule)


def decode_bytes_per_token(config: PretrainedConfig, context_len: float, itemsize: int = 2) -> float:
    """Bytes one decode step of one sequence at ``context_len`` moves: weights, the state read
    and written, the attention layers' KV."""
    full, _ = layer_counts(config)
    kv = full * context_len * 2 * config.num_key_value_heads * config.head_dim * itemsize
    return weight_bytes(config, itemsize) + 2 * state_bytes(config) + kv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.6-35b-a3b", choices=["qwen3.6-35b-a3b", "qwen3.6-27b"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--max-model-len", type=int, help="the engine's (default the config's: 262,144 needs an H200)")
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on the CPU: a tiny Qwen3.6-MoE shape, fp32, short runs"
    )
    args = parser.parse_args()
    shape = SMOKE_SHAPE if args.smoke else args.shape
    result = decode_against_limit(shape, args.smoke, args.input_len, args.output_len, decode_bytes_per_token,
                                  args.max_model_len)  # fmt: skip
    config, itemsize = SHAPES[shape](), 4 if args.smoke else 2
    input_len, output_len = (16, 8) if args.smoke else (args.input_len, args.output_len)
    result["bytes_per_token"] = {
        "total": decode_bytes_per_token(config, input_len + output_len / 2, itemsize),
        "weights": weight_bytes(config, itemsize),
        "state_read_and_written": 2 * state_bytes(config),
    }
    if not args.skip_throughput:
        result["throughput"] = throughput(shape, args.smoke)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
