"""Load generator for a running xinfer (or any OpenAI-compatible) server, in the manner
of ``vllm bench serve``: random prompts of a set input length, a fixed output length
(``ignore_eos``), requests sent at a Poisson or fixed rate under a concurrency cap.
Prints one JSON line per concurrency level and sampling mode (greedy, then sampled:
temperature 0.8, top-p 0.95, a seed per request): request and token throughput, and
TTFT, TPOT, ITL and end-to-end latency (mean, p50, p99) in milliseconds.

    python benchmarks/serve.py --launch --concurrency 1,8,32 --input-len 128 --output-len 64
    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --request-rate 4 --num-prompts 100

Dummy-weight shapes need ``--random-ids VOCAB`` and a folder from
``shapes.shape_folder(name, tokenizer=True)``: without a tokenizer the server streams no
text, so every chunk would arrive at the end and TTFT, TPOT and ITL mean nothing
(``mean_chunks`` shows how many chunks a request streamed; per-token streaming gives
``output_len``).

``--launch`` starts ``python -m xinfer.server`` (with ``--server-args``) on a free port
and stops it afterwards; with ``--offline-peer`` the same prompts then run through an
in-process engine built from the same ``--server-args`` (through the async engine the
server runs) under the same concurrency caps, so the server's own cost shows. On the CPU:

    python benchmarks/serve.py --launch --server-args "--cpu --max-model-len 256" --concurrency 1,4 \
        --input-len 32 --output-len 8 --offline-peer
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name"
).split()


SAMPLING = {"greedy": {"temperature": 0}, "sampled": {"temperature": 0.8, "top_p": 0.95}}


@dataclass
class Result:
    ok: bool
    latency: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    chunks: int = 0
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    mean = statistics.fmean(ms) if ms else float("nan")
    return {
        f"mean_{name}_ms": round(mean, 2),
        f"p50_{name}_ms": round(percentile(ms, 50), 2),
        f"p99_{name}_ms": round(percentile(ms, 99), 2),
    }


async def random_prompts(
    http: httpx.AsyncClient, count: int, input_len: int, rng: random.Random, random_ids: int | None = None
) -> list[list[int]]:
    """Token-id prompts of exactly ``input_len`` tokens, cut from random English words,
    or drawn uniformly from ``[0, random_ids)`` (for dummy-weight models without a tokenizer)."""
    if random_ids:
        return [[rng.randrange(random_ids) for _ in range(input_len)] for _ in range(count)]
    prompts = []
    for _ in range(count):
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        response = await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        response.raise_for_status()
        prompts.append(response.json()["tokens"][:input_len])
    return prompts


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, sampling: str = "greedy", seed: int = 0
) -> Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,
        **SAMPLING[sampling],
        **({"seed": seed} if sampling == "sampled" else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    last, result = start, Result(ok=True)
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Result(ok=False, error=f"{response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):  # the usage-only chunk
                    continue
                now = time.perf_counter()
                result.chunks += 1
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
    except httpx.HTTPError as error:
        return Result(ok=False, error=repr(error))
    result.latency = time.perf_counter() - start
    return result


STEP_COUNTS = ("steps", "step_sequences", "step_tokens")


def step_mix(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The engine's steps between two readings of its counters: how many, and their mean sequences and tokens."""
    steps, seqs, tokens = (after[name] - before[name] for name in STEP_COUNTS)
    return {"steps": steps, "mean_step_sequences": round(seqs / max(steps, 1), 2),
            "mean_step_tokens": round(tokens / max(steps, 1), 2)}  # fmt: skip


async def server_step_counts(http: httpx.AsyncClient) -> dict[str, float]:
    lines = (await http.get("/metrics")).text.splitlines()
    values = dict(line.rsplit(" ", 1) for line in lines if line.startswith("xinfer_step"))
    return {name: float(values.get(f"xinfer_{name}_total", "nan")) for name in STEP_COUNTS}


async def run_level(
    args: argparse.Namespace,
    http: httpx.AsyncClient,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    rng: random.Random,
    sampling: str,
) -> dict:
    gate = asyncio.Semaphore(concurrency)

    async def limited(prompt: list[int], seed: int) -> Result:
        async with gate:
            return await one_request(http, model, prompt, args.output_len, sampling, seed)

    tasks = []
    counts = await server_step_counts(http)
    start = time.perf_counter()
    for seed, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(limited(prompt, seed)))
        if args.request_rate != float("inf"):
            gap = 1 / args.request_rate if args.fixed_rate else rng.expovariate(args.request_rate)
            await asyncio.sleep(gap)
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    report = {
        "benchmark": "serve",
        "sampling": sampling,
        "concurrency": concurrency,
        "request_rate": args.request_rate,
        "arrivals": "fixed" if args.fixed_rate else "poisson",
        "num_prompts": len(prompts),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": round(duration, 2),
        "request_throughput": round(len(done) / duration, 3),
        "output_throughput": round(output_tokens / duration, 2),
        "total_token_throughput": round((output_tokens + args.input_len * len(done)) / duration, 2),
        **summary("ttft", [r.ttft for r in done]),
        **summary("tpot", tpots),
        **summary("itl", [gap for r in done for gap in r.itls]),
        **summary("e2el", [r.latency for r in done]),
        "mean_chunks": round(statistics.fmean(r.chunks for r in done), 2) if done else float("nan"),
        **step_mix(counts, await server_step_counts(http)),
    }
    if len(done) < len(results):
        report["first_error"] = next(r.error for r in results if not r.ok)
    return report


async def benchmark(args: argparse.Namespace, base_url: str) -> list[tuple[int, list[list[int]]]]:
    """Runs every level; returns the prompts of each level."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as http:
        card = (await http.get("/v1/models")).json()["data"][0]
        model = args.model or card["id"]
        rng = random.Random(args.seed)
        levels = [int(c) for c in args.concurrency.split(",")]
        counts = [int(n) for n in args.num_prompts.split(",")] if args.num_prompts else [max(2 * c, 8) for c in levels]
        if len(counts) == 1:
            counts *= len(levels)
        if len(counts) != len(levels):
            raise SystemExit("--num-prompts takes one count, or one per concurrency level")
        runs = []
        for concurrency, count in zip(levels, counts):
            prompts = await random_prompts(http, count, args.input_len, rng, args.random_ids)
            if args.warmup:  # the level's batch shapes, in each mode, captured before it is timed
                for sampling in args.sampling:
                    await asyncio.gather(*(one_request(http, model, p, 4, sampling) for p in prompts[:concurrency]))
            for sampling in args.sampling:
                print(json.dumps(await run_level(args, http, model, prompts, concurrency, rng, sampling)), flush=True)
            runs.append((concurrency, prompts))
        return runs


async def offline_peer(args: argparse.Namespace, runs: list[tuple[int, list[list[int]]]]) -> None:
    """The same prompts, under the same caps, through the engine the launched server ran (built from its own
    arguments, stepped by its own engine thread): no HTTP, no JSON, no streaming of text."""
    from xinfer.engine.async_engine import AsyncEngine, EngineState
    from xinfer.engine.engine import LLMEngine
    from xinfer.sampling import SamplingParams
    from xinfer.server.args import parse_args
    from xinfer.server.launch import prepare

    server = parse_args(shlex.split(args.server_args))
    _, config = prepare(server)
    engine = AsyncEngine(lambda: LLMEngine(config), max_waiting=server.max_waiting)
    engine.start()
    await asyncio.to_thread(engine.wait_loaded)
    if engine.state is EngineState.DEAD:
        raise SystemExit(f"the offline peer's engine did not load: {engine.error}")

    async def generate(prompt: list[int], output_len: int, sampling: str = "greedy", seed: int = 0) -> int:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, seed=seed if sampling == "sampled" else None,
                                **SAMPLING[sampling])  # fmt: skip
        choices = await engine.collect(await engine.submit([(prompt, params)]))
        return len(choices[0].token_ids)

    def engine_step_counts() -> dict[str, float]:
        return {name: getattr(engine.stats, f"num_{name}") for name in STEP_COUNTS}

    async def level(prompts: list[list[int]], concurrency: int, sampling: str) -> int:
        """Output tokens of ``prompts``, each seeded by its index, at most ``concurrency`` at a time."""
        gate = asyncio.Semaphore(concurrency)

        async def limited(prompt: list[int], seed: int) -> int:
            async with gate:
                return await generate(prompt, args.output_len, sampling, seed)

        return sum(await asyncio.gather(*(limited(prompt, seed) for seed, prompt in enumerate(prompts))))

    try:
        for (concurrency, prompts), sampling in itertools.product(runs, args.sampling):
            if args.warmup and sampling == args.sampling[0]:  # as the server's run was warmed
                for mode in args.sampling:
                    await asyncio.gather(*(generate(p, 4, mode) for p in prompts[:concurrency]))
            counts = engine_step_counts()
            start = time.perf_counter()
            tokens = await level(prompts, concurrency, sampling)
            duration = time.perf_counter() - start
            await asyncio.sleep(0.05)  # (the engine thread's stats snapshot follows its last step)
            mix = step_mix(counts, engine_step_counts())
            print(
                json.dumps(
                    {
                        "benchmark": "offline-peer",
                        "sampling": sampling,
                        "concurrency": concurrency,
                        "num_prompts": len(prompts),
                        "input_len": args.input_len,
                        "output_len": args.output_len,
                        "duration_s": round(duration, 2),
                        "request_throughput": round(len(prompts) / duration, 3),
                        "output_throughput": round(tokens / duration, 2),
                        **mix,
                    }
                ),
                flush=True,
            )
    finally:
        engine.stop()


def launch(server_args: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "xinfer.server", "--host", "127.0.0.1", "--port", str(port), *shlex.split(server_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy in 600 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default=os.environ.get("XINFER_BENCH_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--launch", action="store_true", help="start python -m xinfer.server for the run")
    parser.add_argument("--server-args", default="", help="flags for the launched server")
    parser.add_argument("--model", help="default: the first model the server lists")
    parser.add_argument("--api-key", default=os.environ.get("XINFER_API_KEY"))
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--num-prompts", help="requests per level, or a count per level (default: 2 x concurrency, at least 8)"
    )
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels, run in turn")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    parser.add_argument("--fixed-rate", action="store_true", help="evenly spaced arrivals instead of Poisson")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--random-ids",
        type=int,
        metavar="VOCAB",
        help="prompts of random token ids below VOCAB instead of tokenized words",
    )
    parser.add_argument("--offline-peer", action="store_true", help="with --launch: rerun in-process afterwards")
    parser.add_argument(
        "--sampling", nargs="+", choices=list(SAMPLING), default=list(SAMPLING), help="modes, in turn at each level"
    )
    args = parser.parse_args()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the launched server is stopped too
    proc = None
    base_url = args.base_url
    if args.launch:
        proc, base_url = launch(args.server_args)
    try:
        runs = asyncio.run(benchmark(args, base_url))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if args.offline_peer and proc is not None:
        asyncio.run(offline_peer(args, runs))


if __name__ == "__main__":
    main()
