"""Qwen3-30B-A3B on dummy weights (whose random routers spread tokens about evenly over
the experts): batch-1 decode against its bandwidth limit, and a throughput run. One JSON
line.

The limit is the copy bandwidth (benchmarks/bandwidth.py) over the bytes a decode step
reads per token: every layer's attention projections and norms, its router and its
``num_experts_per_tok`` active experts (not all 128), the KV cache at the mean context
length, the embedding row and the LM head.

    python benchmarks/moe.py [--input-len 128] [--output-len 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bandwidth import copy_bandwidth
from shapes import SHAPES

HERE = Path(__file__).resolve().parent
SHAPE = "qwen3-30b-a3b"


def decode_bytes_per_token(context_len: float, itemsize: int = 2) -> float:
    config = SHAPES[SHAPE]()
    h, d, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    attention = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads) + 2 * d  # + q/k norms
    router = h * config.num_experts
    experts = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size
    norms = 2 * h
    kv = context_len * 2 * config.num_key_value_heads * d
    per_layer = attention + router + experts + norms + kv
    return itemsize * (layers * per_layer + h + config.vocab_size * h + h)


def offline(*args: str) -> dict:
    command = [sys.executable, str(HERE / "offline.py"), "--shape", SHAPE, "--dtype", "bfloat16", *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its log and errors pass through
    if result.returncode != 0:
        sys.exit(f"offline.py {' '.join(args)} failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    decode = offline("--batch", "1", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                     "--max-num-seqs", "1", "--profile")  # fmt: skip
    limit = bandwidth / decode_bytes_per_token(args.input_len + args.output_len / 2)
    result = {
        "shape": SHAPE,
        "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
        "decode_tok_s": decode["decode_tok_s"],
        "decode_limit_tok_s": round(limit, 1),
        "decode_fraction_of_limit": round(decode["decode_tok_s"] / limit, 3),
        "decode": decode,
    }
    if not args.skip_throughput:
        result["throughput"] = offline("--num-requests", "256", "--input-len", "100:1024", "--output-len", "100:1024",
                                       "--profile")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
