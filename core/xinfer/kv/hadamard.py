"""Random sign flip followed by the orthonormal Walsh–Hadamard transform.

Spreading each vector over all coordinates makes the coordinates nearly Gaussian and
of similar size, so one scale per vector wastes few levels. The map is orthonormal,
so ``rotate(q) · rotate(k) == q · k`` and the query can be rotated instead of undoing
the rotation of the keys.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

SIGN_SEED = 0x5EED


@functools.cache
def signs(head_dim: int, device: torch.device = torch.device("cpu")) -> Tensor:
    """The fixed ±1 flips for ``head_dim`` (same for every layer, head and run); cached
    per device so a captured CUDA graph never copies them."""
    generator = torch.Generator().manual_seed(SIGN_SEED + head_dim)
    return (torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1).to(device)


def hadamard(x: Tensor) -> Tensor:
    """Orthonormal fast WHT over the last dim (a power of two), in fp32; it is its own inverse."""
    *lead, n = x.shape
    assert n & (n - 1) == 0, f"head_dim {n} is not a power of two"
    y = x.float().reshape(-1, n)
    h = 1
    while h < n:
        pairs = y.view(-1, n // (2 * h), 2, h)
        y = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(*lead, n) / math.sqrt(n)


@functools.cache
def rotation(head_dim: int, device: torch.device = torch.device("cpu")) -> Tensor:
    """``R = H · diag(s)`` as a [D, D] fp32 matrix, cached per device (one matmul
    rotates a whole batch of vectors)."""
    return hadamard(torch.diag(signs(head_dim))).T.contiguous().to(device)


def rotate(x: Tensor) -> Tensor:
    """``R · x`` over the last dim, in fp32."""
    return x.float() @ rotation(x.shape[-1], x.device).T


def unrotate(y: Tensor) -> Tensor:
    """The inverse of :func:`rotate`: ``Rᵀ · y``."""
    return y.float() @ rotation(y.shape[-1], y.device)
