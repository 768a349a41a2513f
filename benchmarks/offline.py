"""Offline generation speed on dummy weights: one JSON line per figure.

    python benchmarks/offline.py --shape smollm2-135m --batch 1 --input-len 128 --output-len 128
    python benchmarks/offline.py --shape qwen3-0.6b --num-requests 256 --input-len 100:1024 --output-len 100:1024
"""

from __future__ import annotations

import argparse
import json
import random
import time

from shapes import shape_folder

from xinfer import LLM, SamplingParams


def lengths(spec: str, n: int, rng: random.Random) -> list[int]:
    low, _, high = spec.partition(":")
    return [rng.randint(int(low), int(high or low)) for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--num-requests", "--batch", type=int, default=1, dest="num_requests")
    parser.add_argument("--input-len", default="128", help="N or LOW:HIGH (uniform)")
    parser.add_argument("--output-len", default="128", help="N or LOW:HIGH (uniform)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also report host time per step phase")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    llm = LLM(
        model=shape_folder(args.shape), load_format="dummy", dtype=args.dtype, device=args.device,
        max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
    )
    vocab = llm.engine.hf_config.vocab_size
    inputs = lengths(args.input_len, args.num_requests, rng)
    outputs = lengths(args.output_len, args.num_requests, rng)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in inputs]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]

    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    phases = time_phases(llm) if args.profile else None
    start = time.perf_counter()
    first_token_at = None
    for _ in llm.stream(prompts, params):
        first_token_at = first_token_at or time.perf_counter()
    elapsed = time.perf_counter() - start
    generated = sum(outputs)
    result = {
        "shape": args.shape,
        "device": str(llm.engine.device),
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "output_tok_s": round(generated / elapsed, 2),
        "total_tok_s": round((generated + sum(inputs)) / elapsed, 2),
        "seconds": round(elapsed, 3),
    }
    if args.num_requests == 1:
        result["decode_tok_s"] = round((outputs[0] - 1) / (elapsed - (first_token_at - start)), 2)
    if phases is not None:
        result["steps"] = phases.pop("steps")
        result["ms_per_step"] = {name: round(1e3 * t / max(result["steps"], 1), 3) for name, t in phases.items()}
    print(json.dumps(result))


def time_phases(llm: LLM) -> dict[str, float]:
    """Wraps the engine's step phases with host timers (the device is synchronised at
    each step's token read-back, so 'sample' holds the device time not hidden)."""
    totals = {"steps": 0, "schedule": 0.0, "prepare": 0.0, "forward": 0.0, "sample": 0.0, "step": 0.0}
    engine, runner = llm.engine, llm.engine.runner

    def timed(owner, name, phase):
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                totals[phase] += time.perf_counter() - t
                if phase == "step":
                    totals["steps"] += 1

        setattr(owner, name, wrapper)

    timed(engine, "step", "step")
    timed(engine.scheduler, "schedule", "schedule")
    timed(runner, "prepare", "prepare")
    timed(runner, "sampler", "sample")
    if runner.graphs is not None:
        timed(runner, "graphs", "forward")
    timed(runner.model, "forward", "forward")
    return totals


if __name__ == "__main__":
    main()
