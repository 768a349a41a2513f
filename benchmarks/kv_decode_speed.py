"""Decode speed per KV cache format against bf16 on the GPU, Llama-3.1-8B shape (dummy
weights), side by side in one run, at batch 1 with contexts 1k and 32k and at batch 64
with 8k:

    python benchmarks/kv_decode_speed.py [--formats auto fp8 turbo8 turbo4 turbo3] [--steps 32] [--kv-recent-window 0 16 64]
    python benchmarks/kv_decode_speed.py --smoke   # checks the script on the CPU
    python benchmarks/kv_decode_speed.py --formats auto fp8 --kernels 12   # + where each step's time goes

For each (format, batch, context) the caches of ``batch`` sequences are filled with
``context`` tokens of random keys and values through the format's own write path, then
whole decode steps run as the engine runs them (host preparation, the CUDA graph
replay, sampling; each step launched before the one before it is read back, so the
host's work overlaps the device's). Each JSON line holds the decode tok/s, the step time, the bytes a
step must read (weights + every sequence's K and V at the format's real bytes per
token) and the fraction of the copy bandwidth measured in the same run that this
implies; and, for one layer's attention op alone (the store of the step's K/V and the
attention), its time and the cache bytes it read per second (a CUDA graph of every
layer's attention op, each over its own cache). With ``--kv-recent-window W`` the quantized formats keep each sequence's
last W positions and first block exact too (shadow blocks, filled like the cache); with
several values each quantized format runs at each of them (0: no window). With
``--kernels N``, the same steps run once more under the torch profiler (apart from the
timed run) and each line lists the N kernels that took the most device time per step.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import copy_bandwidth
from profiling import kernel_profiler, top_kernels
from shapes import SHAPES, shape_folder, weight_bytes

from xinfer import LLM, SamplingParams, ops
from xinfer.cache.allocate import attention_layers
from xinfer.engine.scheduler import ScheduledSeq
from xinfer.engine.sequence import Sequence
from xinfer.forward_context import forward_context

CASES = [(1, 1024), (1, 32768), (64, 8192)]
FORMATS = ["auto", "fp8", "turbo8", "turbo4", "turbo3"]
SHAPE = "llama-3.1-8b"
SMOKE_CASES = [(1, 40), (3, 72)]  # --smoke: SmolLM2's shape on the CPU


def allocate(llm: LLM, seq: Sequence, context: int) -> None:
    """Blocks for ``context`` tokens of ``seq``, its last one to compute. With a recent
    window, in chunks as prefill takes them, so that shadows out of reach go back."""
    manager = llm.engine.cache
    has_window = any(pool.recent_window for pool in manager.pools)
    chunk = llm.engine.config.scheduler.max_num_batched_tokens if has_window else context
    for end in [*range(chunk, context, chunk), context]:
        assert manager.allocate(seq, end), "KV pool too small for this case"
        seq.num_computed_tokens = end - 1
        manager.trim(seq)


def fill(llm: LLM, seqs: list[Sequence]) -> None:
    """Random K/V for every token of ``seqs``, written through the format's write path
    (and into the shadow blocks they have)."""
    engine = llm.engine
    config = engine.hf_config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    positions = [(seq.pages[0], p) for seq in seqs for p in range(seq.num_tokens)]
    slot = engine.runner.slot
    slots = torch.tensor([slot(table.blocks, p) for table, p in positions], device=engine.device)
    writes = [(slots, engine.ops.write_kv)]
    if any(table.shadows for table, _ in positions):
        shadows = torch.tensor([slot(table.shadows, p) for table, p in positions], device=engine.device)
        writes.append((shadows, engine.ops.write_shadow_kv))
    for layer in attention_layers(engine.model):
        for all_slots, write in writes:
            for chunk in all_slots.split(1 << 16):
                k = torch.randn(len(chunk), kv_heads, head_dim, device=engine.device, dtype=engine.dtype)
                write(k, torch.randn_like(k), layer.cache, chunk)


def run_steps(llm: LLM, scheduled: list[ScheduledSeq], steps: int) -> float:
    """Seconds per step over ``steps`` decode steps, each launched before the one before
    it is read back (as the engine runs them)."""
    runner = llm.engine.runner
    synchronize(llm.engine.device)
    start = time.perf_counter()
    in_flight = runner.step(scheduled)
    for _ in range(steps - 1):
        launched = runner.step(scheduled)
        in_flight.result()
        in_flight = launched
    in_flight.result()
    synchronize(llm.engine.device)
    return (time.perf_counter() - start) / steps


def decode_steps(llm: LLM, batch: int, context: int, steps: int, kernels: int = 0) -> dict:
    engine = llm.engine
    vocab = engine.hf_config.vocab_size
    seqs = []
    for i in range(batch):
        seq = Sequence(f"speed-{i}", torch.randint(vocab, (context,)).tolist(), SamplingParams(temperature=0))
        allocate(llm, seq, context)  # the step computes the last token
        seqs.append(seq)
    try:
        fill(llm, seqs)
        scheduled = [ScheduledSeq(seq, 1) for seq in seqs]
        for _ in range(3):
            engine.runner.step(scheduled).result()
        step_s = run_steps(llm, scheduled, steps)
        figures = {"step_ms": step_s * 1e3, "tok_s": batch / step_s}
        figures["attention_op_us"] = attention_us(llm, engine.runner.prepare(scheduled))
        if kernels:
            with kernel_profiler() as profiler:
                run_steps(llm, scheduled, steps)
            figures["kernels"] = top_kernels(profiler, kernels, per=steps)
    finally:
        for seq in seqs:
            engine.cache.release(seq)
    return figures


def attention_us(llm: LLM, batch) -> float:
    """One layer's attention op (storing the step's K/V, then attending, as a step runs
    it) on this batch's metadata: on a GPU the mean over a CUDA graph of one call per
    layer, each over its own cache (as a step reads them: from HBM, without launch gaps)."""
    engine = llm.engine
    layers = attention_layers(engine.model)
    config = engine.hf_config
    _, _, step = engine.runner.to_device(batch)
    meta = step.pages[0]
    head_dim = layers[0].cache.head_dim
    tokens = len(batch.input_ids)
    q = torch.randn(tokens, config.num_attention_heads, head_dim, device=engine.device, dtype=engine.dtype)
    k = torch.randn(tokens, config.num_key_value_heads, head_dim, device=engine.device, dtype=engine.dtype)
    v = torch.randn_like(k)
    scale = head_dim**-0.5

    def all_layers():
        for layer in layers:
            ops.current().attention(q, k, v, layer.cache, meta, scale)

    with ops.use(engine.ops), forward_context(step):
        all_layers()  # compiles
        if engine.device.type != "cuda":
            start = time.perf_counter()
            all_layers()
            return (time.perf_counter() - start) / len(layers) * 1e6
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_layers()
    ms = triton.testing.do_bench(graph.replay, rep=200)
    return ms * 1e3 / len(layers)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=FORMATS)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument(
        "--kv-recent-window",
        type=int,
        nargs="+",
        default=[0],
        metavar="W",
        help="quantized formats: keep this many recent positions exact; several values: each format at each",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        metavar="N",
        help="also list the N kernels with the most device time per step (torch profiler, a separate run)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check this script on the CPU: SmolLM2's shape, fp32, small contexts (figures meaningless)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the engine's memory plan

    shape, cases, device, dtype = ("smollm2-135m", SMOKE_CASES, "cpu", torch.float32) if args.smoke else (
        SHAPE, CASES, "cuda", torch.bfloat16)  # fmt: skip
    bandwidth = float("nan") if args.smoke else copy_bandwidth()
    config = SHAPES[shape]()
    weights = weight_bytes(config, dtype.itemsize)
    head_dim = config.hidden_size // config.num_attention_heads
    folder = shape_folder(shape)
    max_len = max(context for _, context in cases) + 16
    runs = [(name, window) for name in args.formats for window in ([0] if name == "auto" else args.kv_recent_window)]
    for name, window in runs:
        # decode steps only: prompt steps no larger than a decode step (fewer graphs to capture)
        max_num_seqs = max(b for b, _ in cases)
        llm = LLM(model=folder, load_format="dummy", dtype=str(dtype).removeprefix("torch."), device=device, kv_cache_dtype=name,
                  kv_recent_window=window, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_seqs,
                  max_model_len=max_len)  # fmt: skip
        per_token = llm.engine.kv_format.bytes_per_token(head_dim, dtype) * config.num_key_value_heads
        for batch, context in cases:
            figures = decode_steps(llm, batch, context, args.steps, args.kernels)
            kv_bytes = batch * context * per_token * config.num_hidden_layers
            step_bytes = weights + kv_bytes
            limit_tok_s = batch * bandwidth / step_bytes
            layer_kv = kv_bytes / config.num_hidden_layers
            row = {
                "format": name, "kv_recent_window": window, "batch": batch, "context": context,
                "decode_tok_s": round(figures["tok_s"], 1), "step_ms": round(figures["step_ms"], 3),
                "step_bytes": step_bytes, "kv_bytes": kv_bytes, "limit_tok_s": round(limit_tok_s, 1),
                "fraction_of_limit": round(figures["tok_s"] / limit_tok_s, 3),
                "attention_op_us": round(figures["attention_op_us"], 1),
                "attention_TB_s": round(layer_kv / figures["attention_op_us"] / 1e6, 3),
                "copy_TB_s": round(bandwidth / 1e12, 3),
            }  # fmt: skip
            if "kernels" in figures:
                row["kernels"] = figures["kernels"]
            print(json.dumps(row), flush=True)
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
