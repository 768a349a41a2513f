"""Memory statistics of the ``mps`` device for planning the KV cache (see
:class:`xinfer.backend.DeviceMemory`).

Apple silicon's memory is unified: the GPU's share is what Metal recommends one process
keep resident (``recommendedMaxWorkingSetSize``, ``torch.mps.recommended_max_memory()``:
about two thirds to three quarters of RAM), and that is the total the plan takes
``--kv-fraction`` of (default 0.9), so the cache never asks for more than Metal will keep
resident, and the rest of RAM stays with the system. Free is that total less what this
process's Metal allocations hold (other processes' memory is invisible here: on a busy
Mac, lower ``--kv-fraction``).

MPS keeps no peak statistics. Its allocator caches the buffers a step frees, so after a
step what the driver holds beyond what it held at :meth:`reset_peak` bounds the step's
peak from above (the plan may give the cache a little less than it could, never more).
"""

from __future__ import annotations

import torch


class MetalMemory:
    def __init__(self, device: torch.device):
        self.device = device
        self.driver_overhead = 0  # what the driver holds beyond live tensors, at reset_peak

    def info(self) -> tuple[int, int]:
        total = torch.mps.recommended_max_memory()
        return max(0, total - torch.mps.driver_allocated_memory()), total

    def allocated(self) -> int:
        return torch.mps.current_allocated_memory()

    def reset_peak(self) -> None:
        self.release_cached()
        self.driver_overhead = max(0, torch.mps.driver_allocated_memory() - torch.mps.current_allocated_memory())

    def peak(self) -> int:
        torch.mps.synchronize()
        return max(torch.mps.current_allocated_memory(), torch.mps.driver_allocated_memory() - self.driver_overhead)

    def release_cached(self) -> None:
        torch.mps.synchronize()
        torch.mps.empty_cache()
