"""CUDA memory statistics for planning the KV cache (see :class:`xinfer.backend.DeviceMemory`)."""

from __future__ import annotations

import torch


class CudaMemory:
    def __init__(self, device: torch.device):
        self.device = device

    def info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
