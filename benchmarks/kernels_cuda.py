"""Time each kernel of the CUDA backend on Llama-3.1-8B shapes; one JSON line per case.

    python benchmarks/kernels_cuda.py [--out DIR] [--sweep] [--kv-formats fp8 turbo4 ...]
    python benchmarks/kernels_cuda.py --smoke     # tiny shapes, CPU, Triton interpreter

Shapes: hidden 4096, 32 query heads, 8 KV heads, head dim 128, MLP 14336, bf16, KV block
size 16; decode at batch 1 (contexts 1k and 32k) and batch 64 (8k), prefill of 2048
tokens (row kernels at 1, 64 and 2048 tokens).

Method: each case captures a CUDA graph of many calls that rotate over enough input sets
to exceed the L2 several times (so the bytes come from HBM and launch gaps are amortized),
and ``triton.testing.do_bench`` times its replays (median; it also flushes the L2 before
each). ``bytes`` is the fewest bytes the kernel must move (each input read once, each
output written once; split-K partials not counted), reported against the copy bandwidth
measured in the same run (``bandwidth.py``: a 4 GiB device-to-device copy by the SMs,
read + write bytes, timed outside a graph: captured in one, the same copy is a memcpy
node that ran at 2.7-2.8 TB/s on the H200). Attention
also reports TFLOP/s (causal: half the score matrix).

The projections of decode steps of 1 and 16 sequences run through cuBLAS and through
the backend's small-batch linear, which picks cuBLAS or one of its own kernel tiles by
measuring each shape and row count (the last line lists its picks).

``--sweep`` also times every tile of those kernels, and the attention kernels over alternative tile
shapes and decode split counts (and quantized decode with the portable code decode
instead of PTX);
``--kv-formats`` adds attention over caches in those formats (filled
with random keys and values through each format's write path, the equalizer random),
``bytes`` then counting each format's real bytes per token; ``--kv-recent-window W``
adds each of them with a recent window (every block with a shadow, filled likewise;
``bytes`` leaves out the few shadow rows read). ``--attention-variant LABEL=PATH`` times
the attention cases also through another copy of ``attention.py`` (a branch's, say:
``git show BRANCH:backends/cuda/xinfer_cuda/kernels/attention.py > /tmp/a.py``), in
the same process, each line labelled. ``--smoke`` checks this script under the interpreter (times meaningless).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from xinfer.kv import LayerKVCache

L2_FLUSH_BYTES = 256 << 20  # rotate inputs over at least this much memory
MAX_INPUT_SETS = 64
MIN_CALLS_PER_GRAPH = 20
# --sweep: (block_m, block_n, num_warps, num_stages) alternatives and decode split counts
SWEEP_SPLITS = (1, 4, 16, 64)
SWEEP_DECODE_TILES = (
    (16, 32, 4, 2),
    (16, 64, 4, 2),
    (16, 128, 4, 2),
    (16, 64, 4, 3),
    (16, 64, 8, 2),
    (16, 128, 8, 2),
    (16, 128, 4, 3),
    (16, 256, 8, 2),
)
SWEEP_PREFILL_TILES = ((128, 32, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 32, 4, 2))


@dataclass(frozen=True)
class Shapes:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    block_size: int = 16
    max_pos: int = 131072
    row_tokens: tuple[int, ...] = (1, 64, 2048)
    decode: tuple[tuple[int, int], ...] = ((1, 1024), (1, 32768), (64, 8192))  # (batch, context)
    prefill_tokens: int = 2048


SMOKE = Shapes(
    hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1000, max_pos=1024,
    row_tokens=(1, 8), decode=((1, 64), (4, 100)), prefill_tokens=40,
)  # fmt: skip


@dataclass
class Case:
    kernel: str
    case: str
    make_call: Callable[[], Callable[[], object]]  # builds one input set, returns its call
    set_bytes: int  # memory one input set occupies
    bytes: int  # fewest bytes one call moves
    flops: int = 0
    extra: dict | None = None


def _rand(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device).to(dtype)


def row_cases(s: Shapes, ops, dtype: torch.dtype, device: torch.device) -> list[Case]:
    el = torch.tensor([], dtype=dtype).element_size()
    cos_sin = _rand(s.max_pos, s.head_dim, dtype=torch.float32, device=device)  # one per model
    h, i = s.hidden, s.intermediate
    cases = []
    for t in s.row_tokens:

        def norm(t=t):
            x, w = _rand(t, h, dtype=dtype, device=device), _rand(h, dtype=dtype, device=device)
            return lambda: ops.rms_norm(x, w, 1e-5)

        def norm_residual(t=t):
            x, r = _rand(t, h, dtype=dtype, device=device), _rand(t, h, dtype=dtype, device=device)
            w = _rand(h, dtype=dtype, device=device)
            return lambda: ops.rms_norm(x, w, 1e-5, r)

        def rotary(t=t):
            q = _rand(t, s.heads, s.head_dim, dtype=dtype, device=device)
            k = _rand(t, s.kv_heads, s.head_dim, dtype=dtype, device=device)
            pos = torch.randint(0, s.max_pos, (t,), device=device)
            return lambda: ops.rotary(q, k, pos, cos_sin)

        def act(name, t=t):
            def make():
                x = _rand(t, 2 * i, dtype=dtype, device=device)
                fn = getattr(ops, name)
                return lambda: fn(x)

            return make

        def write_kv(t=t):
            num_blocks = math.ceil(t / s.block_size) * 4
            k = _rand(t, s.kv_heads, s.head_dim, dtype=dtype, device=device)
            v = _rand(t, s.kv_heads, s.head_dim, dtype=dtype, device=device)
            cache_shape = (num_blocks, s.block_size, s.kv_heads, s.head_dim)
            k_cache = _rand(*cache_shape, dtype=dtype, device=device)
            v_cache = _rand(*cache_shape, dtype=dtype, device=device)
            slots = torch.randperm(num_blocks * s.block_size, device=device)[:t]
            cache = LayerKVCache.plain(k_cache, v_cache)
            return lambda: ops.write_kv(k, v, cache, slots)

        qk = t * (s.heads + s.kv_heads) * s.head_dim * el
        kv = 2 * t * s.kv_heads * s.head_dim * el
        cache = 4 * math.ceil(t / s.block_size) * s.block_size * s.kv_heads * s.head_dim * el * 2
        cases += [
            Case("rms_norm", f"t{t}", norm, 2 * t * h * el + h * el, 2 * t * h * el + h * el),
            Case("rms_norm_residual", f"t{t}", norm_residual, 4 * t * h * el + h * el, 4 * t * h * el + h * el),
            Case("rotary", f"t{t}", rotary, 2 * qk, 2 * qk + t * (s.head_dim * 4 + 8)),
            Case("silu_and_mul", f"t{t}", act("silu_and_mul"), 3 * t * i * el, 3 * t * i * el),
            Case("gelu_tanh_and_mul", f"t{t}", act("gelu_tanh_and_mul"), 3 * t * i * el, 3 * t * i * el),
            Case("write_kv", f"t{t}", write_kv, kv + cache, 2 * kv + 8 * t),
        ]  # fmt: skip
    return cases


def linear_cases(s: Shapes, ops, dtype: torch.dtype, device: torch.device, sweep: bool) -> list[Case]:
    """The projections of decode steps of 1 and 16 sequences: cuBLAS, the backend's
    small-batch linear (the kernel it measured fastest for the shape and row count),
    and with ``sweep`` each tile it chooses from."""
    import torch.nn.functional as F

    from xinfer_cuda.kernels import gemv
    from xinfer_cuda.linear import candidates

    el = torch.tensor([], dtype=dtype).element_size()
    projections = {
        "qkv": ((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden),
        "o": (s.hidden, s.heads * s.head_dim),
        "gate_up": (2 * s.intermediate, s.hidden),
        "down": (s.hidden, s.intermediate),
        "lm_head": (s.vocab, s.hidden),
    }
    cases = []
    for rows, (name, (n, k)) in itertools.product((1, 16), projections.items()):

        def make(linear, rows=rows, n=n, k=k):
            def make_call():
                x, w = _rand(rows, k, dtype=dtype, device=device), _rand(n, k, dtype=dtype, device=device) * 0.02
                return lambda: linear(x, w)

            return make_call

        size = (n * k + rows * (n + k)) * el
        label = f"m{rows}_{name}"
        cases += [
            Case("linear_cublas", label, make(F.linear), size, size),
            Case("linear", label, make(ops.linear), size, size),
        ]
        if sweep:
            for tile in candidates(rows):
                cases.append(Case("gemv", label, make(lambda x, w, t=tile: gemv.gemv(x, w, None, t)), size, size,
                                  extra={"tile": repr(tile)}))  # fmt: skip
    return cases


def _attention_inputs(s, q_lens, seq_lens, dtype, device, kv_format="auto", recent_window=0):
    from xinfer.kv import get_format
    from xinfer.ops import AttentionMetadata, ShadowPages
    from xinfer_cuda.ops import CudaOps

    blocks = [math.ceil(n / s.block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    fmt = get_format(kv_format)
    cache = fmt.allocate(num_blocks, s.block_size, s.kv_heads, s.head_dim, dtype, device)
    if fmt.rotate_keys:  # the key transforms the engine calibrates for such formats
        cache.equalizer = torch.rand(s.kv_heads, s.head_dim, device=device) + 0.5
        cache.key_offset = torch.randn(s.kv_heads, s.head_dim, device=device)
    if recent_window:  # every block keeps a shadow (the window's reads do not depend on how many)
        shape = (num_blocks, s.block_size, s.kv_heads, s.head_dim)
        cache.shadows = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "kv")
        cache.recent_window = recent_window
    slots = torch.arange(num_blocks * s.block_size, device=device)
    ops = CudaOps()
    for chunk in slots.split(1 << 16):  # random keys and values through the format's write path
        k = _rand(len(chunk), s.kv_heads, s.head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        ops.write_kv(k, v, cache, chunk)
        if recent_window:
            ops.write_shadow_kv(k, v, cache, chunk)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)  # scattered blocks
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = order[start : start + n]
        start += n
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=device),
        max_seqlen_q=max(q_lens),
        max_seq_len=max(seq_lens),
        shadows=ShadowPages(tables, torch.full((sum(q_lens),), -1, device=device)) if recent_window else None,
    )
    q = _rand(sum(q_lens), s.heads, s.head_dim, dtype=dtype, device=device)
    return q, cache, meta


def attention_cases(
    s: Shapes,
    dtype: torch.dtype,
    device: torch.device,
    sweep: bool,
    kv_formats: tuple[str, ...] = (),
    recent_window: int = 0,
    variant: tuple[str, ModuleType] | None = None,
) -> list[Case]:
    """Attention cases; with ``variant`` (label, module), through that module's
    ``paged_attention_cache`` instead of the backend's, each case labelled."""
    from xinfer.kv import get_format
    from xinfer_cuda.kernels import attention, kv_codes

    if variant is not None:
        label, attention = variant

    el = torch.tensor([], dtype=dtype).element_size()
    scale = s.head_dim**-0.5
    qo_bytes_per_token = 2 * s.heads * s.head_dim * el
    cases = []

    def case(kernel, name, q_lens, seq_lens, flops, kv_format="auto", window=0, **overrides):
        def make():
            q, cache, meta = _attention_inputs(s, q_lens, seq_lens, dtype, device, kv_format, window)
            return lambda: attention.paged_attention_cache(q, cache, meta, scale, **overrides)

        kv = sum(seq_lens) * s.kv_heads * get_format(kv_format).bytes_per_token(s.head_dim, dtype)
        qo = sum(q_lens) * qo_bytes_per_token
        extra = {k: (v.__dict__ if hasattr(v, "__dict__") else v) for k, v in overrides.items()}
        if kv_format != "auto":
            extra["kv_cache_dtype"] = kv_format
        if window:
            extra["kv_recent_window"] = window
        if variant is not None:
            extra["attention"] = label
        return Case(kernel, name, make, kv + qo, kv + qo, flops, extra or None)

    for batch, context in s.decode:
        flops = 4 * batch * context * s.heads * s.head_dim
        name, q_lens, seq_lens = f"b{batch}_ctx{context}", [1] * batch, [context] * batch
        for kv_format in ("auto", *kv_formats):
            cases.append(case("attention_decode", name, q_lens, seq_lens, flops, kv_format))
            if recent_window and kv_format != "auto":
                cases.append(case("attention_decode", name, q_lens, seq_lens, flops, kv_format, recent_window))
            if not sweep:
                continue
            for splits in SWEEP_SPLITS:
                cases.append(case("attention_decode", name, q_lens, seq_lens, flops, kv_format, num_splits=splits))
            for tiles in SWEEP_DECODE_TILES:
                tile_config = attention.TileConfig(*tiles)
                cases.append(
                    case("attention_decode", name, q_lens, seq_lens, flops, kv_format, decode_tiles=tile_config)
                )
            if kv_format != "auto":  # the portable decode against the device's own
                cases.append(
                    case("attention_decode", name, q_lens, seq_lens, flops, kv_format, decode=kv_codes.PORTABLE)
                )
            if kv_format in ("auto", "fp8"):  # rows in halves against whole rows
                for halves in (True, False):
                    cases.append(case("attention_decode", name, q_lens, seq_lens, flops, kv_format, halves=halves))
    t = s.prefill_tokens
    flops = 4 * (t * (t + 1) // 2) * s.heads * s.head_dim
    for kv_format in ("auto", *kv_formats):
        cases.append(case("attention_prefill", f"t{t}", [t], [t], flops, kv_format))
        if recent_window and kv_format != "auto":
            cases.append(case("attention_prefill", f"t{t}", [t], [t], flops, kv_format, recent_window))
    if sweep:
        for tiles in SWEEP_PREFILL_TILES:
            tile_config = attention.TileConfig(*tiles)
            cases.append(case("attention_prefill", f"t{t}", [t], [t], flops, prefill_tiles=tile_config))
    return cases


def time_case(case: Case, device: torch.device, smoke: bool) -> tuple[float, int, int]:
    """Seconds per call, input sets, calls per graph."""
    sets = max(1, min(MAX_INPUT_SETS, math.ceil(L2_FLUSH_BYTES / max(case.set_bytes, 1))))
    if smoke:
        sets = 2
    calls = [case.make_call() for _ in range(sets)]
    for call in calls:  # compile, and warm up outside the capture
        call()
    n = sets * math.ceil(MIN_CALLS_PER_GRAPH / sets)
    if smoke:
        start = time.perf_counter()
        for i in range(n):
            calls[i % sets]()
        return (time.perf_counter() - start) / n, sets, n
    import triton.testing

    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n):
            calls[i % sets]()
    ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    del graph
    return ms * 1e-3 / n, sets, n


def _load_module(name: str, path: str) -> ModuleType:
    if not os.path.isfile(path):
        sys.exit(f"--attention-variant: no file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for results.jsonl (also printed)")
    parser.add_argument(
        "--sweep", action="store_true", help="also time each GEMV tile, attention tile shapes and split counts"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--only", default="", help="comma-separated kernel names to run")
    parser.add_argument("--kv-formats", nargs="*", default=[], help="also time attention over these KV cache formats")
    parser.add_argument(
        "--kv-recent-window",
        type=int,
        default=0,
        metavar="W",
        help="also time attention over the --kv-formats caches keeping each query's last W keys exact",
    )
    parser.add_argument(
        "--attention-variant",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also time the attention cases through another copy of the backend's attention.py "
        "(for example one taken from a branch with git show), side by side; repeatable",
    )
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
        device, dtype, shapes = torch.device("cpu"), torch.float16, SMOKE
        copy_bw = float("nan")
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device (use --smoke to check the script on CPU)")
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, Shapes()
        from bandwidth import copy_bandwidth  # the script's folder is on sys.path

        copy_bw = copy_bandwidth()

    import triton

    from xinfer_cuda.ops import CudaOps

    torch.manual_seed(0)
    header = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]),
    }
    lines = [header, {"kernel": "copy", "gb_per_s": round(copy_bw / 1e9, 1)}]
    for line in lines:
        print(json.dumps(line), flush=True)

    ops = CudaOps()
    cases = (
        row_cases(shapes, ops, dtype, device)
        + linear_cases(shapes, ops, dtype, device, args.sweep)
        + attention_cases(shapes, dtype, device, args.sweep, tuple(args.kv_formats), args.kv_recent_window)
    )
    for spec in args.attention_variant:
        label, _, path = spec.partition("=")
        variant = (label, _load_module(f"xinfer_cuda.kernels.attention_{label}", path))
        cases += attention_cases(
            shapes, dtype, device, args.sweep, tuple(args.kv_formats), args.kv_recent_window, variant
        )
    only = {name for name in args.only.split(",") if name}
    for case in cases:
        if only and case.kernel not in only:
            continue
        seconds, sets, calls = time_case(case, device, args.smoke)
        line = {
            "kernel": case.kernel,
            "case": case.case,
            "bytes": case.bytes,
            "time_us": round(seconds * 1e6, 3),
            "gb_per_s": round(case.bytes / seconds / 1e9, 1),
            "frac_copy_bw": round(case.bytes / seconds / copy_bw, 3),
            "input_sets": sets,
            "calls_per_graph": calls,
        }
        if case.flops:
            line["tflop_per_s"] = round(case.flops / seconds / 1e12, 2)
        if case.extra:
            line["overrides"] = case.extra
        lines.append(line)
        print(json.dumps(line), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    choices = {f"m{key[0]} {key[1]}": repr(tile) for key, tile in ops.small_batch_linear.choice.items()}
    if choices:  # the small-batch linear's kernel per row count and weight shape (None: cuBLAS)
        lines.append({"small_batch_linear": choices})
        print(json.dumps(lines[-1]), flush=True)

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernels_cuda.jsonl"), "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
