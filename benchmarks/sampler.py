"""The sampling kernel against a decode step of as many rows, in one run: its time and its
share of the step, for 1, 64 and 256 rows (issue #31's target: <= 3 % for 256 rows of
top-p 0.95 / temperature 0.8 over Qwen3-0.6B's 151,936 tokens). One JSON line.

    python benchmarks/sampler.py                # qwen3-0.6b, on the GPU
    python benchmarks/sampler.py --kernels 20   # also each kernel's time per call, at the most rows
    python benchmarks/sampler.py --smoke        # the same code on the CPU, tiny sizes, Triton's
                                                # interpreter: a check that it runs, not a figure

The decode step: the engine's mean wall time per step (steps are pipelined, so this is
what throughput sees) over ``--steps`` steps of that many greedy sequences decoding after
prompts of ``--input-len`` tokens (dummy weights). The sampling: the CUDA backend's kernel
over [rows, vocab] random logits in the model dtype (N(0, 3): a few hundred tokens at the
top-p cut), replayed from a CUDA graph as inside a step, for each mix of parameters; and
top-p and top-k over near-flat logits (N(0, 0.01) in the model dtype: runs of tied tokens
at the cut), top-p over constant logits (every token tied), over logits like a dummy-weight
model's (N(0, 1.5): 0.02 * sqrt(5120), a wide smooth row) and, at temperature 1, over a long
tail (a few tokens ~12 above an N(10, 2) bulk: the cut deep in the tail, among runs of
thousands of tokens tied in bfloat16). The kernel settles a
row by its whole-row Gumbel-max candidate when that is kept (two passes; most rows at top-p
0.95, every constant row) and searches the others above the candidate: "top-p 0.5" (half the
candidates rejected) shows that path's cost. ``paths`` counts the rows each path settled
(candidate, boundary, tied: a boundary too large to gather whose tokens tie, whole row:
one program scanning the whole row, slow).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable

import torch
from profiling import kernel_profiler, top_kernels
from shapes import shape_folder

from xinfer import LLM, SamplingParams
from xinfer.sampling import SampledRow, SamplingBatch

MIXES = {
    "greedy": SamplingParams(temperature=0),
    "temperature": SamplingParams(temperature=0.8),
    "top-p": SamplingParams(temperature=0.8, top_p=0.95),
    "top-k+top-p": SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    "top-p 0.5": SamplingParams(temperature=0.8, top_p=0.5),
}
FLAT, FLAT_TOP_K, CONSTANT = "top-p, flat logits", "top-k, flat logits", "top-p, constant logits"
DUMMY, TAIL = "top-p, dummy-weight logits", "top-p, temperature 1, long tail"
WORST = {
    FLAT: MIXES["top-p"],
    FLAT_TOP_K: SamplingParams(temperature=0.8, top_k=50),
    CONSTANT: MIXES["top-p"],
    DUMMY: MIXES["top-p"],
    TAIL: SamplingParams(temperature=1.0, top_p=0.95),
}


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Mean seconds of ``fn``: on a GPU replayed from a CUDA graph (as a step runs it)."""
    fn()  # compiles
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    begin.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / repeats


def decode_step_seconds(llm: LLM, rows: int, input_len: int, steps: int, rng: random.Random) -> float:
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(rows):
        engine.add_request(f"decode-{i}", [rng.randrange(vocab) for _ in range(input_len)], params)
    while engine.stats().num_waiting or any(s.num_output_tokens < 2 for s in engine.scheduler.running):
        engine.step()  # prefill, until every sequence decodes
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = (time.perf_counter() - start) / steps
    for i in range(rows):
        engine.abort(f"decode-{i}")
    while engine.has_unfinished():
        engine.step()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--rows", default="1,64,256", help="row counts, comma-separated")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="CALLS",
        help="also each mix's kernels at the most rows, over this many calls (torch profiler)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, smollm2-135m, 1 and 2 rows of 2,000 logits")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernel's module is imported
        args.shape, args.rows, args.input_len, args.steps, args.repeats = "smollm2-135m", "1,2", 8, 2, 1
    from xinfer_cuda.kernels.sampling import sample, sample_paths

    row_counts = [int(r) for r in args.rows.split(",")]
    rng = random.Random(0)
    llm = LLM(
        model=shape_folder(args.shape),
        load_format="dummy",
        dtype="float32" if args.smoke else args.dtype,
        device="cpu" if args.smoke else "auto",
        max_num_seqs=max(row_counts),
        max_model_len=args.input_len + args.steps + 128,
    )
    engine = llm.engine
    device, vocab = engine.device, engine.hf_config.vocab_size
    if args.smoke:
        vocab = 2000
    generator = torch.Generator(device).manual_seed(0)
    result = {
        "benchmark": "sampler",
        "shape": args.shape,
        "device": str(device),
        "vocab": vocab,
        "logits_dtype": str(engine.dtype).removeprefix("torch."),
        "mixes": {
            name: {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}
            for name, p in {**MIXES, **WORST}.items()
        },
        "decode_step_ms": {},
        "sample_ms": {name: {} for name in [*MIXES, *WORST]},
        "share_of_decode_step": {name: {} for name in [*MIXES, *WORST]},
        "paths": {name: {} for name in [*MIXES, *WORST]},
        "kernels_us_per_call": {},
    }
    for rows in row_counts:
        step = decode_step_seconds(llm, rows, args.input_len, args.steps, rng)
        result["decode_step_ms"][rows] = round(step * 1e3, 3)
        logits = (torch.randn(rows, vocab, generator=generator, device=device) * 3).to(engine.dtype)
        flat = (torch.randn(rows, vocab, generator=generator, device=device) * 0.01).to(engine.dtype)
        tail = torch.randn(rows, vocab, generator=generator, device=device) * 2 + 10
        tail[:, :5] += 12 + torch.rand(rows, 5, generator=generator, device=device)
        worst = {
            FLAT: flat,
            FLAT_TOP_K: flat,
            CONSTANT: torch.zeros(rows, vocab, device=device, dtype=engine.dtype),
            DUMMY: (torch.randn(rows, vocab, generator=generator, device=device) * 1.5).to(engine.dtype),
            TAIL: tail.to(engine.dtype),
        }
        for name, params in [*MIXES.items(), *WORST.items()]:
            row_logits = worst.get(name, logits)
            batch = SamplingBatch.of([SampledRow(params, i, args.input_len) for i in range(rows)]).to(device)
            seconds = seconds_per_call(lambda x=row_logits, batch=batch: sample(x, batch), device, args.repeats)
            result["sample_ms"][name][rows] = round(seconds * 1e3, 4)
            result["share_of_decode_step"][name][rows] = round(seconds / step, 4)
            paths = sample_paths(row_logits, batch)[1].bincount(minlength=4).tolist()
            result["paths"][name][rows] = dict(zip(["candidate", "boundary", "tied", "whole_row"], paths))
            if args.kernels and rows == max(row_counts):
                with kernel_profiler() as profiler:
                    for _ in range(args.kernels):
                        sample(row_logits, batch)
                    torch.cuda.synchronize() if device.type == "cuda" else None
                result["kernels_us_per_call"][name] = {
                    k["kernel"]: round(k["ms"] * 1e3 / args.kernels, 1) for k in top_kernels(profiler, 8)
                }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
