"""The batch-1 GEMV over GGUF weights in planes (xinfer_cuda.kernels.plane_linear.plane_gemv): every
one-row tile the CUDA backend measures at start-up (xinfer_cuda.quant_weights.ONE_ROW_PLANE_TILES),
marked ``"before": true`` for those it measured before the warp-a-row, group and early tiles came,
beside cuBLAS on a bf16 weight of the same shape, at Llama-3.1-8B's shapes (q/o, gate/up, down, LM
head) in Q8_0 and Q4_K, and the LM head in Q6_K (Q4_K_M's). Dummy packed weights (random bytes, sane
fp16 scales), bf16 activations.

    python benchmarks/gguf_gemv.py           # on the GPU: one JSON line per (format, shape, tile)
    python benchmarks/gguf_gemv.py --smoke   # on the CPU under the Triton interpreter, tiny shapes

Each time is a CUDA graph of calls cycling over copies of the weight that hold twice the L2
(xinfer_cuda.linear.graph_time, as the start-up measurement), so every call reads its weight from
memory; GB/s are the planes' bytes (the file's) over that time, ``of_bandwidth`` their share of the
device-to-device copy bandwidth measured first in the same run (benchmarks/bandwidth.py). Each tile's
output is checked against the dequantized weight times ``x`` in fp32 (``rel_err``; bf16 rounding
is ~4e-3). The kernels are compiled first by ``--jobs`` processes at once (into Triton's cache), then
lines come as they are measured (the target shapes first), and a summary line per shape: the fastest
tile before and now, and cuBLAS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.kernels.gguf_planes import LAYOUTS, to_planes
from xinfer_cuda.kernels.plane_linear import PlaneGemvConfig, plane_dequantize, plane_gemv
from xinfer_cuda.quant_weights import ONE_ROW_PLANE_TILES

# (format, N, K): gate/up and down first (the targets), q/o, the LM head
SHAPES = [("Q8_0", 14336, 4096), ("Q4_K", 14336, 4096), ("Q8_0", 4096, 14336), ("Q4_K", 4096, 14336),
          ("Q8_0", 4096, 4096), ("Q4_K", 4096, 4096), ("Q8_0", 128256, 4096), ("Q6_K", 128256, 4096)]  # fmt: skip
BEFORE = ONE_ROW_PLANE_TILES[:8]  # the tiles measured before this sweep's


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def timed(call, inputs: list[torch.Tensor], smoke: bool) -> float:
    if smoke:
        start = time.perf_counter()
        call(inputs[0])
        return time.perf_counter() - start
    from xinfer_cuda.linear import graph_time

    return graph_time(call, inputs)


def sweep(fmt: str, n: int, k: int, tiles: tuple[PlaneGemvConfig, ...], bandwidth: float, device: torch.device,
          smoke: bool) -> None:  # fmt: skip
    from xinfer_cuda.linear import l2_overflowing_copies

    planes = to_planes(random_packed(n, k, FORMATS[fmt], device=device), LAYOUTS[fmt])
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    ref = (x.float() @ plane_dequantize(planes, fmt, n, k, torch.float32).T).double()
    copies = [planes] if smoke else l2_overflowing_copies(planes)
    dense = [torch.randn(n, k, device=device, dtype=torch.bfloat16)]
    dense = dense if smoke else l2_overflowing_copies(dense[0])
    shape = {"format": fmt, "n": n, "k": k, "bytes": planes.numel()}

    def rate(seconds: float) -> dict:
        gbps = planes.numel() / seconds / 1e9
        return {"us": round(seconds * 1e6, 2), "GBps": round(gbps, 1), "of_bandwidth": round(gbps * 1e9 / bandwidth, 3)}

    cublas = timed(lambda w: F.linear(x, w), dense, smoke)
    emit({**shape, "kernel": "cublas_bf16", "us": round(cublas * 1e6, 2)})
    best: dict[bool, tuple[float, str]] = {}
    for tile in tiles:
        record = {**shape, "kernel": "plane_gemv", "tile": str(tile), "before": tile in BEFORE}
        try:
            start = time.perf_counter()
            y = plane_gemv(x, planes, fmt, n, None, tile)
            first_call = time.perf_counter() - start  # with the compile, on a cold Triton cache
            err = ((y.double() - ref).norm() / ref.norm()).item()
            seconds = timed(lambda w, tile=tile: plane_gemv(x, w, fmt, n, None, tile), copies, smoke)
        except OutOfResources as e:
            emit({**record, "error": str(e)})
            continue
        emit({**record, **rate(seconds), "rel_err": float(f"{err:.2e}"), "first_call_s": round(first_call, 2)})
        if err < 1e-2:
            for before in {tile in BEFORE, False}:
                if before not in best or seconds < best[before][0]:
                    best[before] = (seconds, str(tile))
    summary = {**shape, "summary": True, "cublas_bf16_us": round(cublas * 1e6, 2)}
    for before, name in ((True, "before"), (False, "now")):
        if before in best:
            summary |= {
                f"{name}_tile": best[before][1],
                **{f"{name}_{key}": v for key, v in rate(best[before][0]).items()},
            }
    emit(summary)
    del copies, dense


def warm(job: tuple[str, int, int, PlaneGemvConfig]) -> None:
    """Compiles (into Triton's cache on disk) the kernels of ``tile`` at a shape, as :func:`sweep` will
    launch them: in a worker process, many at once (compiling is most of a cold run)."""
    fmt, n, k, tile = job
    layout = LAYOUTS[fmt]
    planes = torch.zeros(n * (k // layout.tile) * sum(layout.tile_bytes()), dtype=torch.uint8, device="cuda")
    plane_gemv(torch.zeros(1, k, device="cuda", dtype=torch.bfloat16), planes, fmt, n, None, tile)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter; times meaningless)")
    parser.add_argument("--formats", nargs="+", default=["Q8_0", "Q4_K", "Q6_K"], help="of the shapes to time")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="processes compiling first")
    args = parser.parse_args()
    if args.smoke:
        device, bandwidth = torch.device("cpu"), 1e9
        shapes = [(fmt, 7, 3 * LAYOUTS[fmt].tile) for fmt in ("Q8_0", "Q4_K", "Q6_K")]
    else:
        sys.path.insert(0, os.path.dirname(__file__))
        from bandwidth import copy_bandwidth

        device, bandwidth = torch.device("cuda"), copy_bandwidth()
        emit({"copy_bandwidth_TBps": round(bandwidth / 1e12, 3)})
        shapes = SHAPES
    start = time.perf_counter()
    shapes = [(fmt, n, k) for fmt, n, k in shapes if fmt in args.formats]
    if not args.smoke and args.jobs > 1:
        jobs = [(fmt, n, k, tile) for fmt, n, k in shapes for tile in ONE_ROW_PLANE_TILES]
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            pool.map(warm, jobs, chunksize=1)
        emit({"compiled": len(jobs), "seconds": round(time.perf_counter() - start, 1)})
    for fmt, n, k in shapes:
        sweep(fmt, n, k, ONE_ROW_PLANE_TILES, bandwidth, device, args.smoke)
    emit({"seconds": round(time.perf_counter() - start, 1)})


if __name__ == "__main__":
    main()
