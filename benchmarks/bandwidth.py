"""Device-to-device copy bandwidth (bytes read + written per second), the limit
memory-bound kernels are measured against."""

from __future__ import annotations

import json

import torch
import triton.testing


def copy_bandwidth(gib: float = 4.0) -> float:
    bandwidth = _copy_rate(int(gib * 2**30) // 2)
    torch.cuda.empty_cache()  # the buffers back to the device: a process that goes on (a benchmark's) needs them
    return bandwidth


def _copy_rate(n: int) -> float:
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=500)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


if __name__ == "__main__":
    print(json.dumps({"copy_bandwidth_TBps": round(copy_bandwidth() / 1e12, 3)}))
