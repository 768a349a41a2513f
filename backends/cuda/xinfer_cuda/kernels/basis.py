"""The rotation of :mod:`xinfer.kv.hadamard` as the kernels hold it: the signs of its
transpose, int8 [D, D]. ``x @ signs / sqrt(D)`` rotates and ``y @ signsᵀ / sqrt(D)``
rotates back; ±1 entries make every product exact, and a quarter of fp32's bytes."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from xinfer.kv import hadamard


@functools.cache
def signed_basis(head_dim: int, device: torch.device) -> Tensor:
    """Cached per device, so that a captured CUDA graph never copies it."""
    return hadamard.rotation(head_dim, device).T.sign().to(torch.int8).contiguous()
