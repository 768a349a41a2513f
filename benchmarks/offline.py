"""Offline generation speed on dummy weights: one JSON line per figure, greedy and
sampled (temperature 0.8, top-p 0.95, a seed per request) side by side: the same
prompts run greedy, then sampled, in one engine.

python benchmarks/offline.py --shape smollm2-135m --batch 1 --input-len 128 --output-len 128
python benchmarks/offline.py --shape qwen3-0.6b --num-requests 256 --input-len 100:1024 --output-len 100:1024
python benchmarks/offline.py --shape qwen3-0.6b --workload sharegpt
python benchmarks/offline.py --shape llama-3.1-8b --workload sharegpt --tensor-parallel-size 2   # 2 GPUs

``--workload sharegpt``: 1,000 requests (``--num-requests``) whose input and output
lengths are lognormal with means of about 215 and 198 tokens, as ShareGPT
conversations (fixed seed), clipped to the model's context.

``--floor`` (dense shapes, one GPU, unquantized weights): each run's floor beside it
(floor.py): per step, the longer of its FLOPs at the GEMM rate and its bytes (weights
once, the KV cache read and written in its format) at the copy bandwidth, summed over
the steps the run took; both rates measured in the same process after the runs
(``torch.matmul`` in the run's dtype through the model's own projections at
``max_num_batched_tokens`` rows, best of 10; the copy bandwidth). Adds ``floor_s``, ``floor_output_tok_s``, ``fraction_of_floor`` (the run's
output tok/s over the floor's), ``flops``, ``bytes`` and ``engine_steps`` per run,
``min_steps`` (the fewest the scheduler's limits allow), ``gemm_TFLOPs`` and
``bandwidth_TBps``::

    python benchmarks/offline.py --shape llama-3.1-8b --dtype bfloat16 --num-requests 1000 \\
        --input-len 50:1000 --output-len 50:500 --floor
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import time
from collections.abc import Callable

import floor
from profiling import kernel_profiler, top_kernels
from shapes import SHAPES, shape_folder

from xinfer import LLM, SamplingParams

SAMPLED = dict(temperature=0.8, top_p=0.95)
# ShareGPT-like lengths: lognormal(mu, sigma) has mean exp(mu + sigma^2 / 2)
SHAREGPT_SIGMA = 1.0
SHAREGPT_INPUT_MEAN, SHAREGPT_OUTPUT_MEAN = 215, 198


def lengths(spec: str, n: int, rng: random.Random) -> list[int]:
    low, _, high = spec.partition(":")
    return [rng.randint(int(low), int(high or low)) for _ in range(n)]


def lognormal_lengths(mean: float, n: int, rng: random.Random, limit: int) -> list[int]:
    mu = math.log(mean) - SHAREGPT_SIGMA**2 / 2
    return [min(max(1, round(rng.lognormvariate(mu, SHAREGPT_SIGMA))), limit) for _ in range(n)]


def workload(args: argparse.Namespace, max_model_len: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """Input and output lengths of every request."""
    if args.workload == "uniform":
        return lengths(args.input_len, args.num_requests, rng), lengths(args.output_len, args.num_requests, rng)
    inputs = lognormal_lengths(SHAREGPT_INPUT_MEAN, args.num_requests, rng, max_model_len - 1)
    outputs = lognormal_lengths(SHAREGPT_OUTPUT_MEAN, args.num_requests, rng, max_model_len)
    return inputs, [min(o, max_model_len - i) for i, o in zip(inputs, outputs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument(
        "--model", help="a model file or folder to load instead of --shape's dummy weights (e.g. a GGUF)"
    )
    parser.add_argument("--workload", choices=["uniform", "sharegpt"], default="uniform")
    parser.add_argument(
        "--num-requests", "--batch", type=int, default=None, dest="num_requests", help="default 1; sharegpt: 1000"
    )
    parser.add_argument("--input-len", default="128", help="N or LOW:HIGH (uniform workload)")
    parser.add_argument("--output-len", default="128", help="N or LOW:HIGH (uniform workload)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--sampling", nargs="+", choices=["greedy", "sampled"], default=["greedy", "sampled"], help="runs, in turn"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--isq", help="quantize the weights at load to this packed format (q8_0, q4_k, fp8, ...)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's format (auto, fp8, turbo4, ...)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (its memory plan's)")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per step (prefill chunks); default: the engine's",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also report host time per step phase, and step time by kind and captured shape",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also list the N kernels that took the most device time (torch profiler)",
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch kernels without programmatic dependent launch (CUDA): with --kernels, each kernel's own time, "
        "not its wait for the one before",
    )
    parser.add_argument(
        "--sizes-per-octave",
        type=int,
        default=None,
        help="captured step sizes between powers of two (CUDA backend; for A/B runs)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks (one GPU each, steps run eagerly; docs/distributed.md)",
    )
    parser.add_argument(
        "--floor", action="store_true", help="also each run's floor from its FLOPs and bytes (see above)"
    )
    args = parser.parse_args()
    if args.floor:
        why = floor_refusal(args)
        if why:
            parser.error(why)
    if args.num_requests is None:
        args.num_requests = 1000 if args.workload == "sharegpt" else 1
    if args.no_pdl:
        from xinfer_cuda.kernels import launch

        launch.pdl = lambda device: {"PDL": False, "launch_pdl": False}
    if args.sizes_per_octave:
        from xinfer_cuda import static_step

        static_step.SIZES_PER_OCTAVE = args.sizes_per_octave

    rng = random.Random(args.seed)
    llm = LLM(
        model=args.model or shape_folder(args.shape),
        load_format="auto" if args.model else "dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        enforce_eager=args.enforce_eager,
        tensor_parallel_size=args.tensor_parallel_size,
        isq=args.isq,
        kv_cache_dtype=args.kv_cache_dtype,
        **{name: value for name in ("max_num_seqs", "max_num_batched_tokens") if (value := getattr(args, name))},
    )
    scheduler = llm.engine.config.scheduler
    vocab = llm.engine.hf_config.vocab_size
    inputs, outputs = workload(args, llm.engine.max_model_len, rng)

    def fresh_prompts() -> list[list[int]]:  # each run its own: no run reads another's prefix cache
        return [[rng.randrange(vocab) for _ in range(n)] for n in inputs]

    # warm-up: every kernel variant and recorded step size the runs meet, greedy and sampled
    warm = [prompt[:64] for prompt in fresh_prompts()[: scheduler.max_num_seqs]]
    llm.generate(
        warm, [SamplingParams(max_tokens=8, ignore_eos=True, **SAMPLED if i % 2 else {}) for i in range(len(warm))]
    )
    steps = floor.record_steps(llm.engine.runner) if args.floor else None
    kinds = time_step_kinds(llm) if args.profile else None  # before time_phases wraps runner.graphs
    phases = time_phases(llm) if args.profile else None
    result = {
        "shape": args.model or args.shape,
        "device": str(llm.engine.device),
        "dtype": str(llm.engine.dtype).removeprefix("torch."),
        "workload": args.workload,
        "num_requests": args.num_requests,
        "input_len": args.input_len if args.workload == "uniform" else round(sum(inputs) / len(inputs), 1),
        "output_len": args.output_len if args.workload == "uniform" else round(sum(outputs) / len(outputs), 1),
        "input_tokens": sum(inputs),
        "output_tokens": sum(outputs),
        "max_num_seqs": scheduler.max_num_seqs,
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "kv_cache_dtype": llm.engine.kv_format.name,
        "kv_capacity_tokens": sum(pool.num_blocks * pool.block_size for pool in llm.engine.cache.pools),
    }
    runs: dict[str, tuple[list[floor.Step], float]] = {}  # each run's steps and seconds, with --floor
    for sampling in args.sampling:  # greedy figures keep their old names; sampled ones are prefixed
        prefix = "" if sampling == "greedy" else "sampled_"
        options = SAMPLED if sampling == "sampled" else dict(temperature=0)
        params = [
            SamplingParams(**options, max_tokens=n, ignore_eos=True, seed=i if sampling == "sampled" else None)
            for i, n in enumerate(outputs)
        ]
        prompts = fresh_prompts()
        if kinds is not None:
            kinds.clear()
        if phases is not None:
            phases.update(dict.fromkeys(phases, 0))
        if steps is not None:
            steps.clear()
        profiler = kernel_profiler() if args.kernels else contextlib.nullcontext()
        with profiler:
            start = time.perf_counter()
            started, all_started_at = set(), start  # when every request has its first token
            for delta in llm.stream(prompts, params):
                if delta.request_id not in started:
                    started.add(delta.request_id)
                    all_started_at = time.perf_counter()
            elapsed = time.perf_counter() - start
        result[f"{prefix}output_tok_s"] = round(sum(outputs) / elapsed, 2)
        result[f"{prefix}total_tok_s"] = round((sum(outputs) + sum(inputs)) / elapsed, 2)
        result[f"{prefix}seconds"] = round(elapsed, 3)
        if args.num_requests <= scheduler.max_num_seqs:  # all decode together after their prompts
            decoded = sum(outputs) - len(outputs)
            result[f"{prefix}decode_tok_s"] = round(decoded / (elapsed - (all_started_at - start)), 2)
        if phases is not None:
            step_count = phases["steps"]
            result[f"{prefix}steps"] = step_count
            result[f"{prefix}ms_per_step"] = {
                name: round(1e3 * t / max(step_count, 1), 3) for name, t in phases.items() if name != "steps"
            }
            result[f"{prefix}step_kinds"] = summarize(kinds)
        if args.kernels:
            result[f"{prefix}kernels"] = top_kernels(profiler, args.kernels)
        if steps is not None:
            runs[prefix] = (list(steps), elapsed)
    if args.floor:
        result |= floor_of_runs(llm, runs, inputs, outputs)
    if {"greedy", "sampled"} <= set(args.sampling):
        result["sampled_vs_greedy"] = round(result["sampled_output_tok_s"] / result["output_tok_s"], 3)
    print(json.dumps(result))


def floor_refusal(args: argparse.Namespace) -> str | None:
    if args.model or args.isq or args.tensor_parallel_size > 1:
        return "--floor counts a --shape's unquantized weights on one device (no --model, --isq, tensor parallelism)"
    return floor.refusal(SHAPES[args.shape]().get_text_config())


def floor_of_runs(
    llm: LLM, runs: dict[str, tuple[list[floor.Step], float]], inputs: list[int], outputs: list[int]
) -> dict:
    """Each run's floor (its figures prefixed as its others), from the rates measured now, after the runs."""
    engine, scheduler = llm.engine, llm.engine.config.scheduler
    config = engine.hf_config.get_text_config()
    rates = floor.measure_rates(config, scheduler.max_num_batched_tokens, engine.dtype, engine.device)
    kv_bytes_per_token = (config.num_hidden_layers * config.num_key_value_heads
                          * engine.kv_format.bytes_per_token(floor.head_dim(config), engine.dtype))  # fmt: skip
    result = {
        "gemm_TFLOPs": round(rates.flops_per_s / 1e12, 3),
        "bandwidth_TBps": round(rates.bytes_per_s / 1e12, 3),
        "min_steps": floor.min_steps(inputs, outputs, scheduler.max_num_seqs, scheduler.max_num_batched_tokens),
    }
    for prefix, (steps, seconds) in runs.items():
        figures = floor.report(config, steps, engine.dtype.itemsize, kv_bytes_per_token, rates, sum(outputs), seconds)
        result |= {f"{prefix}{name}": value for name, value in figures.items()}
    return result


def time_phases(llm: LLM, clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Wraps the engine's step phases with host timers. A step is launched before the
    one before it is read back; 'read_back' holds the wait for the device that the
    launch did not hide, and the stop checks."""
    from xinfer.engine.sampler import SampledTokens

    totals = {"steps": 0, "schedule": 0.0, "prepare": 0.0, "forward": 0.0, "sample": 0.0, "read_back": 0.0,
              "step": 0.0}  # fmt: skip
    engine, runner = llm.engine, llm.engine.runner

    def timed(owner, name, phase):
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            t = clock()
            try:
                return inner(*a, **kw)
            finally:
                totals[phase] += clock() - t
                if phase == "step":
                    totals["steps"] += 1

        setattr(owner, name, wrapper)

    timed(engine, "step", "step")
    timed(engine.scheduler, "schedule", "schedule")
    timed(runner, "prepare", "prepare")
    timed(type(runner.sampler), "__call__", "sample")  # on the class: the engine calls the instance's other methods
    timed(SampledTokens, "result", "read_back")
    if runner.graphs is not None:
        timed(runner, "graphs", "forward")
    timed(runner.model, "forward", "forward")
    return totals


def time_step_kinds(llm: LLM) -> list[tuple[tuple[str, int], int, Callable[[], float]]]:
    """Device time of each step (CUDA events around its launch: input copies, replay,
    sampling; the engine does not wait for it), by kind and by the token count of the
    captured shape replayed (0: eager): [((kind, bucket), tokens, seconds)]."""
    import torch

    from xinfer_cuda.static_step import pick_bucket  # the CUDA backend's shapes; --profile is a GPU tool

    runner, records = llm.engine.runner, []
    buckets = runner.graphs.buckets if runner.graphs else None
    inner_step, inner_prepare = runner.step, runner.prepare
    last = {}

    def prepare(scheduled):
        last["batch"] = batch = inner_prepare(scheduled)
        return batch

    def step(scheduled, previous=None, before_sampling=None):
        start, end = (
            (Stamp(), Stamp()) if llm.engine.device.type == "cpu" else (torch.cuda.Event(True), torch.cuda.Event(True))
        )
        start.record()
        try:
            return inner_step(scheduled, previous, before_sampling)
        finally:
            end.record()
            batch = last["batch"]
            bucket = pick_bucket(buckets, batch) if buckets else None
            key = ("decode" if batch.is_decode else "mixed", bucket.num_tokens if bucket else 0)
            records.append((key, len(batch.input_ids), lambda s=start, e=end: s.elapsed_time(e) / 1e3))

    runner.prepare, runner.step = prepare, step
    return records


class Stamp:
    """A host clock with the CUDA event's interface, for the CPU backend (which computes as it launches)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: Stamp) -> float:
        return (end.t - self.t) * 1e3


def summarize(records: list[tuple[tuple[str, int], int, Callable[[], float]]]) -> dict[str, dict]:
    """Per kind: steps, mean real and padded tokens, seconds, and the five shapes that took longest."""
    kinds: dict[tuple[str, int], list[float]] = {}
    for key, tokens, seconds in records:
        row = kinds.setdefault(key, [0, 0, 0.0])
        row[0] += 1
        row[1] += tokens
        row[2] += seconds()
    out = {}
    for kind in ("decode", "mixed"):
        rows = {b: r for (k, b), r in kinds.items() if k == kind}
        steps = sum(r[0] for r in rows.values())
        if not steps:
            continue
        out[kind] = {
            "steps": steps,
            "mean_tokens": round(sum(r[1] for r in rows.values()) / steps, 1),
            "mean_padded_tokens": round(sum(b * r[0] for b, r in rows.items()) / steps, 1),
            "device_seconds": round(sum(r[2] for r in rows.values()), 3),
            "by_shape": {
                b: {
                    "steps": r[0],
                    "mean_tokens": round(r[1] / r[0], 1),
                    "device_ms_per_step": round(1e3 * r[2] / r[0], 2),
                }
                for b, r in sorted(rows.items(), key=lambda item: -item[1][2])[:5]
            },
        }
    return out


if __name__ == "__main__":
    main()
