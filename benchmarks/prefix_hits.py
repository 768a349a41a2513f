"""Prefix-cache hits and time to first token for requests sharing a system prompt, on dummy
weights: one JSON line. For a model with recurrent layers the hits are the state
snapshots' (docs/cache-kinds.md), whose memory the line reports.

python benchmarks/prefix_hits.py --shape qwen3-0.6b --num-requests 64 --system-len 2048
python benchmarks/prefix_hits.py --smoke   # checks the script on the CPU (a tiny Qwen3.5 shape, fp32)

The first request runs alone (its prompt fills the cache: its TTFT is a cold prefill's);
the other ``num_requests - 1`` come together, each the system prompt and user text of its
own (``--user-len`` random tokens). ``hit_rate``: the prompt blocks found cached over
those looked up, over every request; the TTFT figures are the requests' after the first,
from when they were added to when the host read their first token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from shapes import shape_folder

from xinfer import LLM, SamplingParams

SMOKE_SHAPE = "qwen3.5-tiny"


def first_token_times(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds from adding each prompt (all at once) to reading its first token; runs them to the end."""
    engine, start = llm.engine, time.perf_counter()
    ids = [f"r{random.getrandbits(64)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for output in engine.step():
            first.setdefault(output.request_id, time.perf_counter() - start)
    return [first[request_id] for request_id in ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--system-len", type=int, default=2048, help="tokens of the shared system prompt")
    parser.add_argument("--user-len", type=int, default=100, help="tokens of each request's own text")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--state-snapshot-interval", type=int, default=None, help="default: the engine's")
    parser.add_argument("--disable-prefix-cache", action="store_true", help="the same run without prefix caching")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on the CPU: a tiny Qwen3.5 shape, fp32, short prompts"
    )
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.dtype, args.device, args.num_requests = SMOKE_SHAPE, "float32", "cpu", 8
        args.system_len, args.user_len, args.output_len, args.state_snapshot_interval = 256, 20, 4, 128

    options = {"state_snapshot_interval": args.state_snapshot_interval} if args.state_snapshot_interval else {}
    llm = LLM(model=shape_folder(args.shape), load_format="dummy", dtype=args.dtype, device=args.device,
              max_num_seqs=args.max_num_seqs, max_model_len=args.system_len + args.user_len + args.output_len,
              enforce_eager=args.enforce_eager, enable_prefix_caching=not args.disable_prefix_cache,
              seed=args.seed, **options)  # fmt: skip
    engine, rng = llm.engine, random.Random(args.seed)
    vocab = engine.hf_config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    # warm-up: the step sizes the run meets (prompts sharing nothing with it)
    first_token_times(llm, [tokens(args.system_len + args.user_len)], params)
    first_token_times(llm, [tokens(args.user_len) for _ in range(args.num_requests - 1)], params)

    before = engine.stats()
    system = tokens(args.system_len)
    [cold] = first_token_times(llm, [system + tokens(args.user_len)], params)
    warm = first_token_times(llm, [system + tokens(args.user_len) for _ in range(args.num_requests - 1)], params)
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    result = dict(
        shape=args.shape,
        num_requests=args.num_requests,
        system_len=args.system_len,
        user_len=args.user_len,
        prefix_caching=engine.cache.enable_prefix_caching,
        hit_rate=round(hits / queries, 4) if queries else 0.0,
        ttft_first_s=round(cold, 4),
        ttft_mean_s=round(statistics.mean(warm), 4),
        ttft_median_s=round(statistics.median(warm), 4),
    )
    states = engine.cache.states
    if states is not None:
        slot_bytes = sum(t[0].numel() * t.element_size() for cache in states.caches for t in cache.values())
        result |= dict(
            state_snapshot_interval=engine.cache.snapshot_interval,
            state_slot_mib=round(slot_bytes / 2**20, 3),
            snapshot_slots=states.num_snapshots,
            snapshot_memory_gib=round(states.num_snapshots * slot_bytes / 2**30, 3),
            snapshots_held=len(states.snapshots),
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
