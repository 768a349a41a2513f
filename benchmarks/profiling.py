"""Per-kernel device time of a benchmark's run (torch profiler; on a machine without CUDA,
each operator's own CPU time instead, which only checks the script)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def kernel_profiler() -> torch.profiler.profile:
    activity = torch.profiler.ProfilerActivity
    return torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU])


def _time_us(event) -> float:
    return event.device_time_total if torch.cuda.is_available() else event.self_cpu_time_total


def top_kernels(profiler: torch.profiler.profile, n: int, per: int = 1) -> list[dict]:
    """The n kernels with the most device time over the run (graph replays included),
    each with its share of the summed kernel time; ``per`` > 1 adds the time per step of
    a run of that many steps."""
    events = [e for e in profiler.key_averages() if _time_us(e) > 0]
    total = sum(_time_us(e) for e in events)
    events.sort(key=lambda e: -_time_us(e))
    rows = []
    for e in events[:n]:
        row = {"kernel": e.key[:90], "calls": e.count, "ms": round(_time_us(e) / 1e3, 1),
               "share": round(_time_us(e) / total, 3)}  # fmt: skip
        if per > 1:
            row["us_per_step"] = round(_time_us(e) / per, 1)
        rows.append(row)
    return rows


# aten ops that allocate or only read metadata: no kernel on a GPU
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh", "alias", "set_", "resize_"}


def count_launches(fn: Callable[[], object]) -> dict[str, int]:
    """How many kernels ``fn()`` launches, and the most frequent ones.

    On CUDA, the kernels the profiler records (Triton's included); elsewhere the aten ops that
    compute (views and allocations left out), each of which is a kernel on a GPU, which
    estimates the launches of the same code on the CUDA backend where its ops are torch's.
    Elsewhere host reads of a tensor's value (``.item()``) are counted apart."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        with kernel_profiler() as profiler:
            fn()
            torch.cuda.synchronize()
        kernels = Counter()
        for event in profiler.events():
            if event.device_type == torch.autograd.DeviceType.CUDA and not event.name.startswith("Memcpy"):
                kernels[event.name[:60]] += 1
        return {"launches": sum(kernels.values()), **dict(kernels.most_common(8))}
    counter = _OpCounter()
    with counter:
        fn()
    return {"launches": sum(counter.ops.values()), "host_syncs": counter.syncs, **dict(counter.ops.most_common(8))}


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item"):
            self.syncs += 1
        elif not func.is_view and name not in _NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
