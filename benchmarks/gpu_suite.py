"""Everything the GPU machine checks and times, in one call: correctness first, then
benchmarks each beside its peer. Writes results.jsonl and logs into OUT_DIR and
prints a table last.

    python benchmarks/gpu_suite.py OUT_DIR [--only NAME ...] [--gpt-fast-dir .peers/gpt-fast]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from shapes import shape_folder  # noqa: E402

ROOT = HERE.parent
PY = sys.executable


def steps(gpt_fast_dir: str) -> dict[str, list[str]]:
    offline = [PY, str(HERE / "offline.py")]
    return {
        "kernels": [PY, "-m", "pytest", "-q", "-x", str(ROOT / "tests/backends")],
        "e2e": [PY, "-m", "pytest", "-q", "-x", str(ROOT / "tests/gpu")],
        # the quantized KV formats alone (a subset of "kernels"), for a call with little time
        "kv-kernels": [PY, "-m", "pytest", "-q", str(ROOT / "tests/backends/test_kv_formats_cuda.py")],
        "bandwidth": [PY, str(HERE / "bandwidth.py")],
        "decode-8b": offline
        + [
            "--shape",
            "llama-3.1-8b",
            "--batch",
            "1",
            "--input-len",
            "128",
            "--output-len",
            "256",
            "--max-num-seqs",
            "1",
            "--dtype",
            "bfloat16",
            "--profile",
        ],
        "gpt-fast-8b": [PY, str(HERE / "peers/gpt_fast.py"), "--gpt-fast-dir", gpt_fast_dir],
        "kernel-times": [PY, str(HERE / "kernels_cuda.py")],
        # projections of decode steps of 1 and 16 sequences: cuBLAS, the backend's pick, every tile
        "gemv-sweep": [PY, str(HERE / "kernels_cuda.py"), "--sweep", "--only", "linear_cublas,linear,gemv"],
        # decode attention of the quantized formats over tiles, splits, decode method and row layout
        "kv-decode-sweep": [
            PY,
            str(HERE / "kernels_cuda.py"),
            "--sweep",
            "--only",
            "attention_decode",
            "--kv-formats",
            "fp8",
            "turbo8",
            "turbo4",
            "turbo3",
        ],
        "kv-decode-speed": [PY, str(HERE / "kv_decode_speed.py")],
        "throughput-qwen3-0.6b": offline
        + [
            "--shape",
            "qwen3-0.6b",
            "--num-requests",
            "256",
            "--input-len",
            "100:1024",
            "--output-len",
            "100:1024",
            "--dtype",
            "bfloat16",
            "--profile",
        ],
        # the synthetic tokenizer makes the server stream one chunk per token: TTFT and ITL; then the same
        # requests through an in-process async engine (#31 T5: the server within 10 % of it)
        "serve-8b": [
            PY,
            str(HERE / "serve.py"),
            "--launch",
            "--offline-peer",
            "--random-ids",
            "128000",
            "--server-args",
            f"--m {shape_folder('llama-3.1-8b', tokenizer=True)} "
            "--load-format dummy --dtype bf16 --max-num-seqs 64 --max-model-len 4096",
            "--concurrency",
            "1,16,64",
            "--num-prompts",
            "4,32,128",
            "--input-len",
            "1024",
            "--output-len",
            "128",
        ],
        # Qwen3-30B-A3B: batch-1 decode against its bandwidth limit, then 256 requests of 100-1024 in and out
        "moe-30b-a3b": [PY, str(HERE / "moe.py")],
        # issue #32: GLM-4.5-Air's layers, 23 of its 46 (106 GB of bf16): batch-1 decode against its bandwidth limit
        "moe-glm45-air": [PY, str(HERE / "moe.py"), "--shape", "glm-4.5-air", "--skip-throughput"],
        # issue #33: Moonlight-16B-A3B (DeepSeek-V3's MLA): batch-1 decode against its bandwidth limit, and its
        # attention block's launches before the fusions beside today's, per op, in CUDA graphs
        "mla-moonlight": [PY, str(HERE / "mla.py")],
        "mla-layer": [PY, str(HERE / "mla_layer.py")],
        # issue #34: Qwen3.6-35B-A3B (Gated DeltaNet + attention, MoE): batch-1 decode against its bandwidth limit
        # (a 4,096-token engine: the config's 262,144 do not fit beside 67 GB of weights on an H100)
        "hybrid-qwen3.6": [PY, str(HERE / "hybrid.py"), "--max-model-len", "4096", "--skip-throughput"],
        # issue #36: DeepSeek-V4-Flash's layers, 8 of its 43 (108 GB of bf16): batch-1 decode against its bandwidth
        # limit (torch references, no step graphs), the cache's tokens per GiB at 128k against an MLA cache
        "deepseek-v4-flash": [PY, str(HERE / "deepseek_v4.py")],
        # issue #35: Qwen3-VL-8B, one 1024x1024 image (1,024 tokens) + 64 text tokens: TTFT, the encoder alone,
        # and output tok/s of 64 concurrent requests with an image each
        "vision-qwen3-vl-8b": [
            PY,
            str(HERE / "vision.py"),
            "--shape",
            "qwen3-vl-8b",
            "--image-size",
            "1024",
            "--text-tokens",
            "64",
            "--concurrency",
            "64",
        ],
        # issue #37: GGUF-packed weights (the kernels' tests, then per-kernel GB/s and a step's linears,
        # then xinfer and llama.cpp on GGUFs of the Llama-3.1-8B shape written there, Q8_0 and Q4_K_M)
        "quant-kernels": [
            PY,
            "-m",
            "pytest",
            "-q",
            str(ROOT / "tests/backends/test_gguf_kernels.py"),
            str(ROOT / "tests/backends/test_fp4_kernels.py"),
            str(ROOT / "tests/gpu/test_gguf_packed.py"),
            str(ROOT / "tests/gpu/test_llama_cpp_mixes_cuda.py"),
        ],
        "quant-decode-kernels": [PY, str(HERE / "quant_decode.py"), "--kernels", "--linears"],
        # MXFP4 and NVFP4 (--isq of the Llama-3.1-8B shape's dummy weights) against bf16: batch 1 and 256 requests
        "quant-decode-fp4": [PY, str(HERE / "quant_decode.py"), "--mxfp4", "--nvfp4"],
        "quant-decode-8b": [PY, str(HERE / "quant_decode.py"), "--model"],
        # llama.cpp's llama-bench and llama-batched-bench built on the machine (quant_decode.py says how)
        "quant-decode-llama-cpp": [
            PY,
            str(HERE / "quant_decode.py"),
            "--llama-cpp",
            os.environ.get("LLAMA_CPP_BIN", "llama.cpp/build/bin"),
        ],
        # issue #31's workload: 1,000 ShareGPT-like requests, greedy then sampled (top-p 0.95, T 0.8, seeded)
        "sharegpt-0.6b": offline + ["--shape", "qwen3-0.6b", "--workload", "sharegpt", "--dtype", "bfloat16"],
        "sharegpt-8b": offline + ["--shape", "llama-3.1-8b", "--workload", "sharegpt", "--dtype", "bfloat16"],
        # a 256-row top-p sampling step against the Qwen3-0.6B 256-row decode step, as a ratio
        "sampler-0.6b": [PY, str(HERE / "sampler.py"), "--shape", "qwen3-0.6b", "--rows", "256"],
        "throughput-8b": offline
        + [
            "--shape",
            "llama-3.1-8b",
            "--num-requests",
            "1000",
            "--input-len",
            "50:1000",
            "--output-len",
            "50:500",
            "--dtype",
            "bfloat16",
            "--profile",
        ],
    }


# Steps that need more than --timeout: one engine start-up (graph capture, kernel
# compiles) per KV format, ~30 s each for the quantized ones on the H200.
# The throughput runs time greedy and then sampled generation (twice the work); GLM-4.5-Air's
# 106 GB of dummy weights take their time to fill.
LONGER = {"quant-decode-kernels": 540, "quant-decode-8b": 600, "quant-decode-fp4": 600, "quant-decode-llama-cpp": 450,
          "kv-decode-speed": 540, "moe-30b-a3b": 590, "moe-glm45-air": 450, "throughput-8b": 600,
          "throughput-qwen3-0.6b": 450, "sharegpt-8b": 600, "sharegpt-0.6b": 450}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--gpt-fast-dir", default=str(ROOT / ".peers/gpt-fast"))
    parser.add_argument("--timeout", type=int, default=300, help="seconds per step")
    args = parser.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    rows = []
    for name, command in steps(args.gpt_fast_dir).items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        try:
            timeout = max(args.timeout, LONGER.get(name, 0))
            result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
            status, stdout, stderr = (
                ("ok" if result.returncode == 0 else f"exit {result.returncode}"),
                result.stdout,
                result.stderr,
            )
        except subprocess.TimeoutExpired as e:
            status, stdout, stderr = "timeout", e.stdout or "", e.stderr or ""
            stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
        seconds = time.perf_counter() - start
        (out / "logs.txt").open("a").write(f"==== {name} ({status}, {seconds:.0f} s)\n{stdout}\n{stderr[-6000:]}\n")
        figures = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        for figure in figures:
            figure["step"] = name
            (out / "results.jsonl").open("a").write(json.dumps(figure) + "\n")
        summary = stdout.strip().splitlines()[-1] if stdout.strip() else stderr.strip()[-200:]
        rows.append((name, status, seconds, figures[-1] if figures else summary))
        print(f"[{name}] {status} in {seconds:.0f} s", flush=True)
    print("\n| step | status | seconds | result |\n|---|---|---|---|")
    for name, status, seconds, result in rows:
        print(f"| {name} | {status} | {seconds:.0f} | {json.dumps(result) if isinstance(result, dict) else result} |")


if __name__ == "__main__":
    main()
