"""GGUF-packed weights on the GPU: the Llama-3.1-8B shape with dummy packed weights (random
bytes with sane fp16 scales) in Q8_0 and Q4_K_M. JSON lines, then a short table.

Q4_K_M is llama.cpp's mix (llama-quant.cpp, ``LLAMA_FTYPE_MOSTLY_Q4_K_M``): Q4_K everywhere
but Q6_K for the output (LM head) and for ``attn_v`` and ``ffn_down`` of the layers
``use_more_bits`` picks: the first and last eighth of the layers and every third between
(for 32 layers: 0-3, 6, 9, ..., 27, 28-31, 16 in all). The token embedding stays Q4_K and
is not read per token (a row is gathered), so it is not counted in the bytes per token.

Modes:

    python benchmarks/quant_decode.py --kernels      # each layer shape and format alone: GB/s
    python benchmarks/quant_decode.py --linears      # every linear of a decode step in a graph
    python benchmarks/quant_decode.py --dequant      # the planes' dequantize kernel alone, per tile: GB/s
    python benchmarks/quant_decode.py --tiles --batches 16 64   # every candidate tile of the planes' weights
    python benchmarks/quant_decode.py --model        # xinfer on a GGUF of the shape (written first)
    python benchmarks/quant_decode.py --model --llama-cpp BIN   # and llama.cpp's benchmarks on it
    python benchmarks/quant_decode.py --fp8          # FP8 (--isq fp8 of dummy weights) against bf16
    python benchmarks/quant_decode.py --mxfp4 --nvfp4   # MXFP4 and NVFP4 (--isq) against bf16
    python benchmarks/quant_decode.py --smoke        # the script on the CPU (interpreter, tiny shape)

Weights are timed as the CUDA backend holds them: a linear's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K
weight re-laid into planes (xinfer_cuda.kernels.gguf_planes, as at load; the same bytes), the other
formats in their blocks (records: ``"planes"``).

``--kernels`` times each (shape, format) at 1, 16, 64 and 512 rows as the backend runs it (the
fastest of the packed kernels' tiles and the dequantized weight, measured up to 64 rows; the
dequantized weight past that) as a CUDA graph of calls over
copies of the weight that overflow the L2 (xinfer_cuda.linear.graph_time), beside cuBLAS on
the bf16 weight and dequantize-then-cuBLAS, and gives the packed bytes per second against
the copy bandwidth measured in the same run. ``--linears`` captures one decode step's
linears (32 x q, k, v, o, gate, up, down, and the LM head) at batch 1, 16 and 64: the
weights' share of a step, an upper bound on the model's tok/s (attention, norms and
sampling come on top); the bytes limit is the file's bytes per token over the bandwidth.

``--model`` and ``--llama-cpp`` write a GGUF of the shape per scheme (``--gguf-dir``, kept
for reuse: ~8.5 GB for Q8_0, ~4.9 GB for Q4_K_M) with the gguf package: the packed weights
random as above, norms 1, a vocabulary of placeholder tokens. ``--model`` runs xinfer on it
(benchmarks/offline.py: batch 1, prompt 128, 256 greedy steps, decode tok/s; then the
``--batches`` above 1 as that many concurrent requests, greedy and sampled). ``--llama-cpp BIN``
runs llama.cpp's ``llama-bench`` (batch 1) and ``llama-batched-bench`` (``--batches`` above 1) from
the folder ``BIN`` on the same files and the same work (all layers on the GPU), built for
instance with ``cmake -S llama.cpp -B build -DGGML_CUDA=ON && cmake --build build --target
llama-bench llama-batched-bench`` (``BIN`` is then ``build/bin``).

``--kernels`` and ``--linears`` also time FP8 (:mod:`xinfer.quant.fp8_format`: 128 e4m3 codes and a
float32 scale per block), MXFP4 and NVFP4 (:mod:`xinfer.quant.fp4_formats`: e2m1 codes under e8m0
scales per 32, or e4m3 scales per 16 and a float32 per block of 128), all through the weight-only
kernels. ``--fp8`` runs benchmarks/offline.py on the shape's dummy weights in bf16 and quantized at
load to FP8 (``--isq fp8``: the layout an FP8 block-scaled checkpoint loads into), through the
weight-only kernels and through the tensor cores (``XINFER_FP8_MATMUL=tensor-cores``, SM90; one row there the
GEMV over the tensor cores' layout where it measures faster): batch-1
decode tok/s and the output tok/s of ``--requests`` concurrent requests (256). ``--mxfp4`` and
``--nvfp4`` do the same with ``--isq mxfp4`` / ``--isq nvfp4`` (the layouts MXFP4 and NVFP4
checkpoints load into; software decoding, no FP4 tensor cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
from shapes import SHAPES

from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.kernels.gguf_planes import LAYOUTS, to_planes
from xinfer_cuda.kernels.plane_i8_dot import quantize_blocks
from xinfer_cuda.kernels.plane_linear import plane_dequantize, plane_layout, plane_rows
from xinfer_cuda.kernels.quant_linear import dequantize, linear_rows
from xinfer_cuda.quant_weights import GGUF_KERNELS, MEASURED_ROWS, PLANE_KERNELS, measured_rows

SCHEMES = ("Q8_0", "Q4_K_M")  # GGUF files
KERNEL_SCHEMES = (*SCHEMES, "FP8", "MXFP4", "NVFP4")
ISQ_RUNS = {  # --flag: (scheme, --isq, XINFER_FP8_MATMUL) of each run besides bf16
    "fp8": [("FP8 weight-only", "fp8", "weight-only"), ("FP8 tensor cores", "fp8", "tensor-cores")],
    "mxfp4": [("MXFP4 weight-only", "mxfp4", "weight-only")],
    "nvfp4": [("NVFP4 weight-only", "nvfp4", "weight-only")],
}


@dataclass(frozen=True)
class Weight:
    name: str  # llama.cpp's tensor name
    n: int  # output features
    k: int  # input features
    fmt: str

    @property
    def nbytes(self) -> int:
        return FORMATS[self.fmt].row_bytes(self.k) * self.n


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def weights(config, scheme: str) -> list[Weight]:
    """The linears one decode step reads, in order, in ``scheme``'s types."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d = h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def fmt(more_bits: bool = False) -> str:
        return scheme if scheme != "Q4_K_M" else ("Q6_K" if more_bits else "Q4_K")

    out = []
    for i in range(layers):
        more = use_more_bits(i, layers)
        out += [
            Weight(f"blk.{i}.attn_q.weight", q, h, fmt()),
            Weight(f"blk.{i}.attn_k.weight", kv, h, fmt()),
            Weight(f"blk.{i}.attn_v.weight", kv, h, fmt(more)),
            Weight(f"blk.{i}.attn_output.weight", h, q, fmt()),
            Weight(f"blk.{i}.ffn_gate.weight", inter, h, fmt()),
            Weight(f"blk.{i}.ffn_up.weight", inter, h, fmt()),
            Weight(f"blk.{i}.ffn_down.weight", h, inter, fmt(more)),
        ]
    return out + [Weight("output.weight", config.vocab_size, h, fmt(True))]


def graph_seconds(call: Callable[[], object], replays: int = 5) -> float:
    """Seconds per ``call``: the best replay of a CUDA graph of it (eager launches on the
    GPU machine, a VM, take longer than the kernels)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def wall_seconds(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def emit(record: dict) -> dict:
    print(json.dumps(record), flush=True)
    return record


@dataclass(frozen=True)
class Held:
    """A weight as the CUDA backend holds it: a linear's weight of a type with planes re-laid into them
    at load (xinfer_cuda.kernels.gguf_planes), others in the file's blocks; how it is multiplied (in a
    given tile) and dequantized, and its measured tiles."""

    fmt: str
    k: int
    planes: bool

    @staticmethod
    def of(fmt: str, k: int) -> Held:
        return Held(fmt, k, fmt in LAYOUTS and LAYOUTS[fmt].fits(k))

    def bytes_of(self, packed: torch.Tensor) -> torch.Tensor:
        return to_planes(packed, LAYOUTS[self.fmt]) if self.planes else packed

    def linear(self, x: torch.Tensor, w: torch.Tensor, tile) -> torch.Tensor:
        return (plane_rows if self.planes else linear_rows)(x, w, self.fmt, None, tile)

    def dequantize(self, w: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        return (
            plane_dequantize(w, self.fmt, n, self.k, dtype) if self.planes else dequantize(w, self.fmt, self.k, dtype)
        )

    def tile(self, x: torch.Tensor, w: torch.Tensor):
        return (PLANE_KERNELS if self.planes else GGUF_KERNELS).tiles(x, w, self.fmt, None)


def kernel_shapes(config) -> list[tuple[int, int, str]]:
    """Each distinct (rows, columns, format) of the weights a decode step of :data:`KERNEL_SCHEMES` reads."""
    return sorted({(w.n, w.k, w.fmt) for scheme in KERNEL_SCHEMES for w in weights(config, scheme)})


def kernels(config, device: torch.device, bandwidth: float, smoke: bool) -> list[dict]:
    from xinfer_cuda.linear import graph_time, l2_overflowing_copies

    records = []
    for n, k, fmt in kernel_shapes(config):
        held = Held.of(fmt, k)
        packed = held.bytes_of(random_packed(n, k, FORMATS[fmt], device=device))
        copies = [packed] if smoke else l2_overflowing_copies(packed)
        dense = held.dequantize(packed, n, torch.bfloat16)
        dense_copies = [dense] if smoke else [held.dequantize(c, n, torch.bfloat16) for c in copies]
        for rows in (1, 16) if smoke else (1, 16, 64, 512):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            tile = held.tile(x, packed) if rows <= MEASURED_ROWS and not smoke else None

            def packed_call(w: torch.Tensor, x=x, held=held, tile=tile) -> object:
                return held.linear(x, w, tile)

            def dequant_call(w: torch.Tensor, x=x, held=held, n=n) -> object:
                return F.linear(x, held.dequantize(w, n, x.dtype))

            if smoke:
                t = wall_seconds(lambda: packed_call(packed))  # noqa: B023 (called at once)
                times = {"packed": t, "cublas_bf16": t, "dequant_cublas": t}
            else:
                times = {
                    "packed": graph_time(packed_call, copies),
                    "cublas_bf16": graph_time(lambda w, x=x: F.linear(x, w), dense_copies),
                    "dequant_cublas": graph_time(dequant_call, copies),
                }
            gbps = packed.numel() / times["packed"] / 1e9
            records.append(emit({"mode": "kernel", "format": fmt, "planes": held.planes, "n": n, "k": k, "rows": rows,
                                 "tile": str(tile),
                                 **{f"{key}_us": round(v * 1e6, 2) for key, v in times.items()},
                                 "packed_GBps": round(gbps, 1), "of_bandwidth": round(gbps * 1e9 / bandwidth, 3)}))  # fmt: skip
        del copies, dense_copies
    return records


def tile_times(config, device: torch.device, bandwidth: float, smoke: bool, batches: list[int]) -> list[dict]:
    """Every candidate tile of :class:`MeasuredTiles` for each weight in planes of the shape, at each of
    ``batches`` rows: what the measurement chose among, and by how much."""
    from xinfer_cuda.linear import graph_time, l2_overflowing_copies, time_each

    records = []
    for n, k, fmt in kernel_shapes(config):
        held = Held.of(fmt, k)
        if not held.planes:
            continue
        if smoke:
            n, k = 32, 2 * LAYOUTS[fmt].tile
        packed = held.bytes_of(random_packed(n, k, FORMATS[fmt], device=device))
        copies = [packed] if smoke else l2_overflowing_copies(packed)
        for rows in batches:
            x = torch.randn(rows, k, device=device, dtype=torch.float32 if smoke else torch.bfloat16)
            tiles = PLANE_KERNELS.tiles.candidates(fmt, measured_rows(rows), x.dtype)
            calls = {tile: lambda w, x=x, tile=tile, held=held: held.linear(x, w, tile) for tile in tiles}
            timer = (lambda call, inputs: wall_seconds(lambda: call(inputs[0]))) if smoke else graph_time
            for tile, seconds in time_each(timer, calls, copies, device).items():
                records.append(emit({"mode": "tile", "format": fmt, "n": n, "k": k, "rows": rows, "tile": str(tile),
                                     "us": round(seconds * 1e6, 2),
                                     "of_bandwidth": round(packed.numel() / seconds / bandwidth, 3)}))  # fmt: skip
            if rows == 1 and not smoke:  # the int8 GEMV's times include its activations' quantization: alone
                fields = plane_layout(fmt, k).fields
                quantize = graph_time(
                    lambda x, fields=fields: quantize_blocks(x, order=fields), [x.clone() for _ in range(8)]
                )
                records.append(emit({"mode": "quantize", "format": fmt, "k": k, "us": round(quantize * 1e6, 2)}))
        del copies
    return records


DEQUANT_TILES = [
    (block_n, values, warps)
    for block_n in (1, 2, 4, 16)
    for values in (256, 1024)
    for warps in (2, 4, 8)
    if block_n * values <= 16384  # (the program's values are in registers)
]


def dequants(device: torch.device, bandwidth: float, smoke: bool) -> list[dict]:
    """The planes' dequantize kernel alone (what more than 16 rows multiply densely after), for each of
    :data:`DEQUANT_TILES` (rows a program, values of a row a program, warps): its bytes read and written a second
    against the copy bandwidth."""
    from xinfer_cuda.linear import graph_time, l2_overflowing_copies

    records = []
    for fmt, (n, k) in [(fmt, shape) for fmt in ("Q8_0", "Q4_K", "Q6_K") for shape in ((14336, 4096), (4096, 14336))]:
        if smoke:
            n, k = 32, 512
        planes = to_planes(random_packed(n, k, FORMATS[fmt], device=device), LAYOUTS[fmt])
        copies = [planes] if smoke else l2_overflowing_copies(planes)
        moved = planes.numel() + 2 * n * k
        for block_n, values, warps in DEQUANT_TILES[:2] if smoke else DEQUANT_TILES:
            tiles = max(1, values // LAYOUTS[fmt].tile)

            def call(w, block_n=block_n, tiles=tiles, warps=warps) -> object:
                return plane_dequantize(w, fmt, n, k, torch.bfloat16, block_n, tiles, warps)  # noqa: B023

            record = {"mode": "dequant", "format": fmt, "n": n, "k": k, "block_n": block_n, "tiles": tiles,
                      "num_warps": warps}  # fmt: skip
            try:
                seconds = wall_seconds(lambda: call(planes)) if smoke else graph_time(call, copies)  # noqa: B023
            except Exception as error:  # noqa: BLE001 (a tile that does not compile or fit: the others still run)
                records.append(emit(record | {"error": f"{type(error).__name__}: {error}"[:200]}))
                continue
            record |= {"us": round(seconds * 1e6, 2), "of_bandwidth": round(moved / seconds / bandwidth, 3)}
            records.append(emit(record))
    return records


def linears(config, device: torch.device, bandwidth: float, smoke: bool, batches: list[int]) -> list[dict]:
    records = []
    for scheme in KERNEL_SCHEMES:
        plan = weights(config, scheme)
        held = [Held.of(w.fmt, w.k) for w in plan]
        packed = [h.bytes_of(random_packed(w.n, w.k, FORMATS[w.fmt], device=device)) for w, h in zip(plan, held)]
        file_bytes = sum(w.nbytes for w in plan)
        for batch in batches:
            xs = {k: torch.randn(batch, k, device=device, dtype=torch.bfloat16) for k in {w.k for w in plan}}

            tiles = [h.tile(xs[w.k], p) if batch <= MEASURED_ROWS and not smoke else None
                     for w, h, p in zip(plan, held, packed)]  # fmt: skip

            def step(plan=plan, held=held, packed=packed, xs=xs, tiles=tiles) -> None:
                for w, h, p, tile in zip(plan, held, packed, tiles):
                    h.linear(xs[w.k], p, tile)

            t = wall_seconds(step) if smoke else graph_seconds(step)
            record = {"mode": "linears", "scheme": scheme, "batch": batch, "step_ms": round(t * 1e3, 3),
                      "tok_s": round(batch / t, 1), "bytes_per_token_GB": round(file_bytes / 1e9, 3)}  # fmt: skip
            if batch == 1:
                limit = bandwidth / file_bytes
                record |= {"limit_tok_s": round(limit, 1), "of_limit": round(1 / t / limit, 3)}
            records.append(emit(record))
        del packed
    return records


def write_gguf(config, scheme: str, path: Path) -> None:
    """The shape as a llama GGUF in ``scheme``: random packed weights (the token embedding in
    the scheme's base type), norms of ones, placeholder tokens (and the newline llama.cpp
    looks up)."""
    import gguf
    import numpy as np

    base = "Q8_0" if scheme == "Q8_0" else "Q4_K"
    plan = weights(config, scheme)
    plan.insert(0, Weight("token_embd.weight", config.vocab_size, config.hidden_size, base))
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = [f"t{i}" for i in range(config.vocab_size)]
    tokens[10] = "\u010a"  # the byte-level newline
    # one merge (llama.cpp refuses a BPE vocabulary without any), of tokens the vocabulary has (tokenizers checks)
    tokens[20:23] = ["a", "b", "ab"]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    ones = np.ones(config.hidden_size, dtype=np.float32)
    for w in plan:
        if w.name.startswith("blk.") and w.name.endswith("attn_q.weight"):
            layer = w.name.split(".")[1]
            writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
            writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
        packed = random_packed(w.n, w.k, FORMATS[w.fmt]).numpy()
        writer.add_tensor(w.name, packed, raw_dtype=gguf.GGMLQuantizationType[w.fmt])
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_file(config, scheme: str, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"llama-3.1-8b-shape-{scheme}.gguf"
    if not path.exists():
        start = time.perf_counter()
        write_gguf(config, scheme, path.with_suffix(".part"))
        path.with_suffix(".part").rename(path)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s",
              file=sys.stderr)  # fmt: skip
    return path


def xinfer_model(config, folder: Path, bandwidth: float, batches: list[int], dtype: str) -> list[dict]:
    records = []
    for scheme in SCHEMES:
        path = gguf_file(config, scheme, folder)
        file_bytes = sum(w.nbytes for w in weights(config, scheme))
        for batch in batches:
            sampling = ["greedy"] if batch == 1 else ["greedy", "sampled"]
            command = [sys.executable, str(Path(__file__).parent / "offline.py"), "--model", str(path), "--batch",
                       str(batch), "--input-len", "128", "--output-len", "256", "--sampling", *sampling, "--dtype", dtype]  # fmt: skip
            result = subprocess.run(command, stdout=subprocess.PIPE, text=True)  # its log passes through
            if result.returncode != 0:
                records.append(emit({"mode": "model", "scheme": scheme, "batch": batch, "error": result.returncode}))
                continue
            run = json.loads(result.stdout.strip().splitlines()[-1])
            record = {"mode": "model", "scheme": scheme, "batch": batch, "tok_s": run.get("decode_tok_s", run["output_tok_s"]),
                      "output_tok_s": run["output_tok_s"], "sampled_output_tok_s": run.get("sampled_output_tok_s")}  # fmt: skip
            if batch == 1:
                limit = bandwidth / file_bytes
                record |= {"limit_tok_s": round(limit, 1), "of_limit": round(record["tok_s"] / limit, 3)}
            records.append(emit(record))
    return records


def llama_cpp(config, folder: Path, bandwidth: float, binaries: Path, batches: list[int]) -> list[dict]:
    """llama.cpp's own benchmarks on the same GGUFs and work as :func:`xinfer_model`'s (a 128-token context, 256
    tokens generated): ``llama-bench`` at batch 1, ``llama-batched-bench`` past it (decode tok/s of all streams)."""
    records = []
    for scheme in SCHEMES:
        path = str(gguf_file(config, scheme, folder))
        limit = bandwidth / sum(w.nbytes for w in weights(config, scheme))
        single = json.loads(_run(binaries / "llama-bench", "-m", path, "-ngl", "99", "-p", "0", "-n", "256", "-d", "128",
                                 "-r", "3", "-o", "json"))  # fmt: skip
        tok_s = single[0]["avg_ts"]
        records.append(emit({"mode": "llama.cpp", "scheme": scheme, "batch": 1, "tok_s": round(tok_s, 1),
                             "limit_tok_s": round(limit, 1), "of_limit": round(tok_s / limit, 3)}))  # fmt: skip
        many = [batch for batch in batches if batch > 1]
        if not many:
            continue
        output = _run(binaries / "llama-batched-bench", "-m", path, "-ngl", "99", "-c", str(max(many) * (128 + 256)),
                      "-npp", "128", "-ntg", "256", "-npl", ",".join(map(str, many)), "--output-format", "jsonl")  # fmt: skip
        for run in (json.loads(line) for line in output.splitlines() if line.startswith("{")):
            records.append(
                emit({"mode": "llama.cpp", "scheme": scheme, "batch": run["pl"], "tok_s": round(run["speed_tg"], 1)})
            )
    return records


def _run(*command: object) -> str:
    """A llama.cpp tool's stdout (its log on stderr passes through)."""
    return subprocess.run([str(c) for c in command], stdout=subprocess.PIPE, text=True, check=True).stdout


def isq_models(chosen: list[str], requests: int, smoke: bool) -> list[dict]:
    """bf16 and the ``chosen`` runs of :data:`ISQ_RUNS` (FP8 on the tensor cores on SM90 only): batch-1
    decode and ``requests`` concurrent ones."""
    sm90 = not smoke and torch.cuda.get_device_capability()[0] == 9
    runs = [("bf16", None, "weight-only")]
    runs += [run for flag in chosen for run in ISQ_RUNS[flag] if run[2] == "weight-only" or sm90]
    shape = "smollm2-135m" if smoke else "llama-3.1-8b"
    records = []
    for name, isq, matmul in runs:
        for batch in (1, 3 if smoke else requests):
            command = [sys.executable, str(Path(__file__).parent / "offline.py"), "--shape", shape, "--batch",
                       str(batch), "--input-len", "128", "--output-len", "256", "--sampling", "greedy",
                       "--dtype", "float32" if smoke else "bfloat16", *(["--isq", isq] if isq else [])]  # fmt: skip
            if smoke:
                command += ["--device", "cpu", "--output-len", "4", "--input-len", "8"]
            env = {**os.environ, "XINFER_FP8_MATMUL": matmul}
            result = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env)
            if result.returncode != 0:
                records.append(emit({"mode": "isq", "scheme": name, "batch": batch, "error": result.returncode}))
                continue
            run = json.loads(result.stdout.strip().splitlines()[-1])
            tok_s = run.get("decode_tok_s", run["output_tok_s"]) if batch == 1 else run["output_tok_s"]
            records.append(emit({"mode": "isq", "scheme": name, "batch": batch, "tok_s": tok_s}))
    return records


def tiny_config():
    config = SHAPES["llama-3.1-8b"]()
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = 256, 256, 2
    config.num_attention_heads, config.num_key_value_heads, config.vocab_size = 4, 2, 64
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernels", action="store_true", help="time each (layer shape, format) alone")
    parser.add_argument("--linears", action="store_true", help="time a decode step's linears in a CUDA graph")
    parser.add_argument("--dequant", action="store_true", help="time the planes' dequantize kernel's tiles alone")
    parser.add_argument("--tiles", action="store_true", help="time every candidate tile of the planes at --batches")
    parser.add_argument("--model", action="store_true", help="xinfer on a GGUF of the shape (batch 1 and --batches)")
    parser.add_argument("--llama-cpp", type=Path, metavar="BIN",
                        help="llama.cpp's build folder of llama-bench and llama-batched-bench: run on the same GGUFs")  # fmt: skip
    for flag in ISQ_RUNS:
        parser.add_argument(f"--{flag}", action="store_true", help=f"--isq {flag} against bf16, batch 1 and --requests")
    parser.add_argument("--requests", type=int, default=256, help="concurrent requests of --fp8, --mxfp4, --nvfp4")
    parser.add_argument("--gguf-dir", type=Path, default=Path("/tmp/quant_decode"), help="where the GGUFs are kept")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64], help="batch sizes of --linears, --model")
    parser.add_argument("--smoke", action="store_true", help="tiny shape, CPU, Triton interpreter (times meaningless)")
    parser.add_argument("--out", type=Path, help="also write the records to this JSON file")
    args = parser.parse_args()
    chosen = [flag for flag in ISQ_RUNS if getattr(args, flag)]
    if not (args.kernels or args.linears or args.dequant or args.tiles or args.model or args.llama_cpp or chosen):
        args.kernels = args.linears = True
    if args.smoke:
        config, device, bandwidth = tiny_config(), torch.device("cpu"), 1e9
        args.batches = [1, 3]
    else:
        from bandwidth import copy_bandwidth

        config, device = SHAPES["llama-3.1-8b"](), torch.device("cuda")
        bandwidth = copy_bandwidth()
        emit({"copy_bandwidth_TBps": round(bandwidth / 1e12, 3)})
    records = []
    if args.kernels:
        records += kernels(config, device, bandwidth, args.smoke)
    if args.linears:
        records += linears(config, device, bandwidth, args.smoke, args.batches)
    if args.dequant:
        records += dequants(device, bandwidth, args.smoke)
    if args.tiles:
        records += tile_times(config, device, bandwidth, args.smoke, args.batches)
    if args.model:
        records += xinfer_model(config, args.gguf_dir, bandwidth, args.batches, "float32" if args.smoke else "bfloat16")
    if args.llama_cpp:
        records += llama_cpp(config, args.gguf_dir, bandwidth, args.llama_cpp, args.batches)
    if chosen:
        records += isq_models(chosen, args.requests, args.smoke)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))
    print(f"{'what':44} {'us / ms':>10} {'GB/s or tok/s':>14} {'of limit':>9}")
    for r in records:
        if r["mode"] == "kernel":
            what = f"{r['format']} {r['n']}x{r['k']} rows {r['rows']} (cuBLAS bf16 {r['cublas_bf16_us']} us)"
            print(f"{what:44} {r['packed_us']:>10} {r['packed_GBps']:>14} {r['of_bandwidth']:>9}")
        elif r["mode"] == "tile":
            what = f"{r['format']} {r['n']}x{r['k']} rows {r['rows']} {r['tile']}"
            print(f"{what:44} {r['us']:>10} {'':>14} {r['of_bandwidth']:>9}")
        elif r["mode"] == "dequant":
            what = f"dequantize {r['format']} {r['n']}x{r['k']} {r['block_n']} rows, {r['tiles']} tiles, {r['num_warps']} warps"
            print(f"{what:44} {r.get('us', r.get('error')):>10} {'':>14} {r.get('of_bandwidth', ''):>9}")
        elif r["mode"] == "quantize":
            what = f"quantize one row of {r['k']} for {r['format']}"
            print(f"{what:44} {r['us']:>10}")
        elif r["mode"] == "linears":
            what = f"{r['scheme']} linears of a step, batch {r['batch']}"
            print(f"{what:44} {r['step_ms']:>10} {r['tok_s']:>14} {r.get('of_limit', ''):>9}")
        else:
            what = f"{r['mode']} {r['scheme']} decode, batch {r['batch']}"
            print(f"{what:44} {'':>10} {r.get('tok_s', r.get('error')):>14} {r.get('of_limit', ''):>9}")


if __name__ == "__main__":
    main()
