"""One sampling step against one decode step of the same batch, in one run: the
sampler's cost as a share of the step (issue #31's target: <= 3 % for 256 rows of
top-p 0.95 / temperature 0.8 over Qwen3-0.6B's 151,936 tokens). One JSON line.

    python benchmarks/sampler.py                       # qwen3-0.6b, 256 rows, on the GPU
    python benchmarks/sampler.py --shape smollm2-135m --rows 4 --input-len 16 --device cpu

The decode step: the engine's mean wall time per step (steps are pipelined, so this is
what throughput sees) over ``--steps`` steps of ``--rows`` greedy sequences decoding after
prompts of ``--input-len`` tokens (dummy weights). The sampling step: the backend's
``sample`` op over [rows, vocab] logits in the model dtype (replayed from a CUDA graph
on the GPU, as inside a step), sampled, greedy, and the torch reference's for scale.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

import torch
from shapes import shape_folder

from xinfer import LLM, SamplingParams, ops
from xinfer.sampling import SampledRow, SamplingBatch
from xinfer.torch_ops import TorchOps


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeats: int, graphed: bool = True) -> float:
    """Mean seconds of ``fn``: on a GPU replayed from a CUDA graph (as a step runs it), or eager
    where ``fn`` waits for the device (the torch reference's data-dependent branches)."""
    fn()  # compiles
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats
    run = fn
    if graphed:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    run()
    begin.record()
    for _ in range(repeats):
        run()
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
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(0)
    llm = LLM(
        model=shape_folder(args.shape),
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.rows,
        max_model_len=args.input_len + args.steps + 128,
    )
    engine = llm.engine
    device, vocab = engine.device, engine.hf_config.vocab_size
    decode = decode_step_seconds(llm, args.rows, args.input_len, args.steps, rng)

    generator = torch.Generator(device).manual_seed(0)
    logits = (torch.randn(args.rows, vocab, generator=generator, device=device) * 3).to(engine.dtype)
    sampled = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    batches = {
        "sampled": SamplingBatch.of([SampledRow(sampled, i, args.input_len) for i in range(args.rows)]).to(device),
        "greedy": SamplingBatch.of([SampledRow(SamplingParams(temperature=0), i, 0) for i in range(args.rows)]).to(
            device
        ),
    }
    result = {
        "benchmark": "sampler",
        "shape": args.shape,
        "device": str(device),
        "rows": args.rows,
        "vocab": vocab,
        "logits_dtype": str(engine.dtype).removeprefix("torch."),
        "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k},
        "decode_step_ms": round(decode * 1e3, 3),
    }
    for backend_name, backend, graphed in [("", engine.ops, True), ("torch_reference_", TorchOps(), False)]:
        with ops.use(backend):
            for name, batch in batches.items():
                seconds = seconds_per_call(lambda b=batch: ops.sample(logits, b), device, args.repeats, graphed)
                result[f"{backend_name}{name}_sample_ms"] = round(seconds * 1e3, 4)
    result["sampled_share_of_decode_step"] = round(result["sampled_sample_ms"] / result["decode_step_ms"], 4)
    result["greedy_share_of_decode_step"] = round(result["greedy_sample_ms"] / result["decode_step_ms"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
