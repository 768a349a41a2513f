"""FP8 weights (xinfer.quant.fp8_format) at one row on Llama-3.1-8B's shapes, on the GPU: the weight-only GEMV
with e4m3 decoded by integer operations (the SM70 path) against the hardware's conversion (SM89 and up), each the
best of the backend's one-row tiles, and the GEMV over the tensor cores' layout (xinfer_cuda.kernels.fp8_gemv) and
that layout's padded block-scaled product, beside bf16 cuBLAS; times from CUDA graphs over copies that overflow the L2,
and the packed bytes per second against the copy bandwidth measured in the same run. Then which row counts
cuBLASLt's block-scaled FP8 (the SM90 default path) accepts. One JSON line per figure.

    python benchmarks/fp8_gemv.py
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from bandwidth import copy_bandwidth

from xinfer.quant import get_weight_format, quantized
from xinfer_cuda.fp8_tensor_cores import (
    GEMV_WARPS,
    TENSOR_CORE_KERNELS,
    split,
    tensor_core_product,
    to_tensor_core_layout,
)
from xinfer_cuda.kernels import quant_linear
from xinfer_cuda.kernels.fp8_gemv import fp8_gemv
from xinfer_cuda.kernels.gguf_blocks import FORMATS, random_packed
from xinfer_cuda.linear import graph_time, l2_overflowing_copies
from xinfer_cuda.quant_weights import candidates

FP8 = FORMATS["FP8"]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # N x K


def one_row_seconds(x: torch.Tensor, packed: torch.Tensor, hardware_conversion: bool) -> float:
    """The best one-row tile's seconds per call, e4m3 decoded one way or the other."""
    quant_linear.converts_e4m3 = lambda device: hardware_conversion
    copies = l2_overflowing_copies(packed)
    return min(
        graph_time(lambda w, tile=tile: quant_linear.quant_linear(x, w, "FP8", None, tile), copies)
        for tile in candidates(FP8, 1)
    )


def gemv_figures(bandwidth: float) -> None:
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        packed = random_packed(n, k, FP8, device="cuda")
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        tensor_cores = to_tensor_core_layout(quantized(packed, get_weight_format("fp8"), (n, k))).raw
        seconds = {
            "integer_decode": one_row_seconds(x, packed, False),
            "e4m3_conversion": one_row_seconds(x, packed, True),
            **{f"tensor_cores_layout_gemv_{warps}_warps": graph_time(lambda w, x=x, warps=warps:
                                                                     fp8_gemv(x, *split(w), None, warps),
                                                                     l2_overflowing_copies(tensor_cores))
               for warps in GEMV_WARPS},
            "tensor_cores_padded": graph_time(lambda w, x=x: tensor_core_product(x, *split(w), None),
                                              l2_overflowing_copies(tensor_cores)),
            "bf16_cublas": graph_time(lambda w, x=x: F.linear(x, w), l2_overflowing_copies(dense)),
        }  # fmt: skip
        limit = packed.numel() / bandwidth
        print(json.dumps({"shape": name, "n": n, "k": k, **{f"{path}_us": round(s * 1e6, 2) for path, s in seconds.items()},
                          "fp8_of_bytes_limit": {path: round(limit / s, 3) for path, s in seconds.items()
                                                 if path != "bf16_cublas"}}), flush=True)  # fmt: skip


def tensor_core_rows() -> None:
    weight = to_tensor_core_layout(
        quantized(random_packed(4096, 4096, FP8, scale=1e-2, device="cuda"), get_weight_format("fp8"), (4096, 4096))
    )
    for rows in (1, 2, 8, 16, 128):
        try:
            TENSOR_CORE_KERNELS.linear(torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16), weight)
            print(json.dumps({"tensor_cores_rows": rows, "ok": True}))
        except RuntimeError as error:
            print(json.dumps({"tensor_cores_rows": rows, "ok": False, "error": str(error).splitlines()[0][:200]}))


if __name__ == "__main__":
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_TBps": round(bandwidth / 1e12, 3)}))
    gemv_figures(bandwidth)
    tensor_core_rows()
