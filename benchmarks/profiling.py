"""Per-kernel device time of a benchmark's run (torch profiler; on a machine without CUDA,
each operator's own CPU time instead, which only checks the script)."""

from __future__ import annotations

import torch


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
