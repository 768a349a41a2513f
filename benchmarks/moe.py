"""A mixture-of-experts shape on dummy weights (whose random routers spread tokens about
evenly over the experts): batch-1 decode against its bandwidth limit, and a throughput run.
One JSON line.

The limit is the copy bandwidth (benchmarks/bandwidth.py) over the bytes a decode step
reads per token (:func:`decode_bytes_per_token`): every layer's attention projections,
their biases and q/k norms where the config has them, and its two norms; the MLP of the
first ``first_k_dense_replace`` layers whole; in the others the router (with its correction
bias, in fp32 where the model keeps it so), the ``num_experts_per_tok`` active experts (not
all of them) and the shared experts; the KV cache at the mean context length; the embedding
row, the final norm and the LM head.

    python benchmarks/moe.py [--shape qwen3-30b-a3b] [--input-len 128] [--output-len 256]
    python benchmarks/moe.py --shape glm-4.5-air
    python benchmarks/moe.py --expert-share   # also the experts' share of the throughput run's GPU time
    python benchmarks/moe.py --smoke   # checks the script on the CPU (a tiny GLM-4.5 shape, fp32)

``--expert-share`` runs the throughput workload once more, greedy, under the torch profiler (slower than the timed
runs: its figures are shares and rates, not speed): the fraction of the summed kernel time spent in the expert GEMM
kernels and in routing, and the experts' achieved TFLOP/s (every computed token through ``num_experts_per_tok``
experts of 6 x h x moe_intermediate_size FLOPs in each MoE layer, the shared experts left out: they run as dense
GEMMs).

GLM-4.5-Air's shape, one bf16 decode step at context 0, as
``decode_bytes_per_token(SHAPES["glm-4.5-air"](), 0)`` counts it (h = 4096, d = 128, 96 query
and 8 KV heads, 128 experts of 1408 of which 8 are active, one shared, a dense first layer of
10944, vocabulary 151552, 23 layers)::

    attention  2 x (4096 x 128 x (2 x 96 + 2 x 8) + 128 x (96 + 2 x 8) + 2 x 4096) =     218,148,864 per layer
    dense MLP  2 x 3 x 4096 x 10944                                                  =     268,959,744 (layer 0)
    MoE        2 x 9 x 3 x 4096 x 1408 + 4 x (128 x 4096 + 128)                      =     313,524,736 per layer
    ends       2 x (4096 + 4096 + 151552 x 4096)                                     =   1,241,530,368
    total      23 x 218,148,864 + 268,959,744 + 22 x 313,524,736 + 1,241,530,368     =  13,425,458,176
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bandwidth import copy_bandwidth
from shapes import SHAPES, has_qk_norm
from transformers import PretrainedConfig

HERE = Path(__file__).resolve().parent
SMOKE_SHAPE = "glm4-moe-tiny"


def decode_bytes_per_token(config: PretrainedConfig, context_len: float, itemsize: int = 2) -> float:
    """Bytes one decode step of one sequence at ``context_len`` reads, weights at ``itemsize``."""
    h, d, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    attention = h * d * (2 * heads + 2 * kv_heads)
    if getattr(config, "attention_bias", False):
        attention += d * (heads + 2 * kv_heads)  # q, k and v
    if has_qk_norm(config):
        attention += 2 * d
    norms = 2 * h
    kv = context_len * 2 * kv_heads * d
    dense = getattr(config, "first_k_dense_replace", 0)
    dense_mlp = 3 * h * config.intermediate_size
    experts = config.num_experts_per_tok + getattr(config, "n_shared_experts", 0)
    moe_mlp = experts * 3 * h * config.moe_intermediate_size
    ends = h + h + config.vocab_size * h  # the embedding row, the final norm, the LM head
    per_layer = itemsize * (attention + norms + kv)
    return (layers * per_layer + itemsize * (dense * dense_mlp + (layers - dense) * moe_mlp + ends)
            + (layers - dense) * router_bytes(config, itemsize))  # fmt: skip


def router_bytes(config: PretrainedConfig, itemsize: int) -> int:
    """GLM-4.5's router keeps its weight and its correction bias in fp32; Qwen3's is the model's dtype."""
    if config.model_type == "glm4_moe":
        return 4 * (config.n_routed_experts * config.hidden_size + config.n_routed_experts)
    return itemsize * config.num_experts * config.hidden_size


def offline(shape: str, dtype: str, *args: str) -> dict:
    command = [sys.executable, str(HERE / "offline.py"), "--shape", shape, "--dtype", dtype, *args]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its log and errors pass through
    if result.returncode != 0:
        sys.exit(f"offline.py {' '.join(args)} failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def decode_against_limit(
    shape: str,
    smoke: bool,
    input_len: int,
    output_len: int,
    bytes_per_token: Callable[[PretrainedConfig, float, int], float],
    max_model_len: int | None = None,
) -> dict:
    """Batch-1 decode of ``shape`` (bf16; fp32 on the CPU with ``smoke``, short) against the copy bandwidth over
    the bytes a token moves at the run's mean context (``bytes_per_token(config, context, itemsize)``);
    ``max_model_len``: the engine's, where the config's does not fit beside the weights (Qwen3.6-35B-A3B's 262,144
    on an 80 GB GPU)."""
    dtype, itemsize, device = ("float32", 4, "cpu") if smoke else ("bfloat16", 2, "auto")
    input_len, output_len = (16, 8) if smoke else (input_len, output_len)
    # steps of at most the prompt: the memory plan keeps no room for 8,192-token steps (DeepSeek V4's 8 layers
    # leave too little beside its 108 GB of weights)
    decode = offline(shape, dtype, "--device", device, "--batch", "1", "--input-len", str(input_len), "--output-len",
                     str(output_len), "--max-num-seqs", "1", "--max-num-batched-tokens", str(input_len),
                     *(["--max-model-len", str(max_model_len)] if max_model_len else []), "--profile")  # fmt: skip
    bandwidth = float("nan") if smoke else copy_bandwidth()  # after the run: its 8 GiB of buffers would crowd it
    limit = bandwidth / bytes_per_token(SHAPES[shape](), input_len + output_len / 2, itemsize)
    return {
        "shape": shape,
        "copy_bandwidth_TBps": round(bandwidth / 1e12, 3),
        "decode_tok_s": decode["decode_tok_s"],
        "decode_limit_tok_s": round(limit, 1),
        "decode_fraction_of_limit": round(decode["decode_tok_s"] / limit, 3),
        "decode": decode,
    }


def throughput(shape: str, smoke: bool) -> dict:
    """256 requests with input and output lengths uniform in 100..1024 (8 short ones with ``smoke``)."""
    dtype, device = ("float32", "cpu") if smoke else ("bfloat16", "auto")
    requests, lengths = ("8", "8:32") if smoke else ("256", "100:1024")
    return offline(shape, dtype, "--device", device, "--num-requests", requests, "--input-len", lengths,
                   "--output-len", lengths, "--profile")  # fmt: skip


# the Triton kernels of backends/cuda/xinfer_cuda/kernels/moe.py (grouped for many tokens, per slot for few)
EXPERT_KERNELS = frozenset({"_grouped_gate_up_kernel", "_grouped_down_kernel", "_slot_gate_up_kernel",
                            "_token_down_kernel", "_fused_slot_kernel", "_gate_up_kernel", "_down_kernel",
                            "_sum_parts_kernel"})  # fmt: skip
ROUTING_KERNELS = frozenset({"_route_kernel", "_rank_slots_kernel", "_place_slots_kernel"})


def expert_share(shape: str, smoke: bool) -> dict:
    """The throughput workload under the profiler: the expert and routing kernels' share of the kernel time, and
    the experts' TFLOP/s."""
    dtype, device = ("float32", "cpu") if smoke else ("bfloat16", "auto")
    requests, lengths = ("8", "8:32") if smoke else ("256", "100:1024")
    run = offline(shape, dtype, "--device", device, "--num-requests", requests, "--input-len", lengths,
                  "--output-len", lengths, "--sampling", "greedy", "--kernels", "200")  # fmt: skip
    kernels = run["kernels"]
    experts = [k for k in kernels if k["kernel"] in EXPERT_KERNELS]
    config = SHAPES[shape]()
    computed = run["input_tokens"] + run["output_tokens"] - run["num_requests"]  # the last token is never fed back
    moe_layers = config.num_hidden_layers - getattr(config, "first_k_dense_replace", 0)
    flops = computed * moe_layers * config.num_experts_per_tok * 6 * config.hidden_size * config.moe_intermediate_size
    expert_ms = sum(k["ms"] for k in experts)
    return {
        "expert_share": round(sum(k["share"] for k in experts), 3),
        "routing_share": round(sum(k["share"] for k in kernels if k["kernel"] in ROUTING_KERNELS), 3),
        "expert_ms": round(expert_ms, 1),
        "expert_TFLOPs": round(flops / (expert_ms / 1e3) / 1e12, 1) if expert_ms else None,
        "expert_kernels": experts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=["qwen3-30b-a3b", "glm-4.5-air"])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument(
        "--expert-share", action="store_true", help="the experts' share of the throughput run's GPU time"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on the CPU: a tiny GLM-4.5 shape, fp32, short runs"
    )
    args = parser.parse_args()
    shape = SMOKE_SHAPE if args.smoke else args.shape
    result = decode_against_limit(shape, args.smoke, args.input_len, args.output_len, decode_bytes_per_token)
    if not args.skip_throughput:
        result["throughput"] = throughput(shape, args.smoke)
    if args.expert_share:
        result["expert_share"] = expert_share(shape, args.smoke)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
