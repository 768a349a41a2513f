"""A per-channel equalizer for rotated keys: keys ``k / s`` and queries ``q · s`` before
the rotation, so every score ``(q · s) · (k / s) = q · k`` is unchanged.

A rotated key's quantization error is spread evenly over its coordinates, so a score's
error grows with the key's whole size; but queries and keys of real models put their
energy in different channels. With ``s² = √(E[k²] / E[q²])`` per channel the two carry
the same energy in every channel, which minimises the expected score error for a given
key error (Cauchy–Schwarz). ``s`` is one vector per (layer, KV head), measured once on
calibration text before any token is cached, so every cached block shares it.
"""

from __future__ import annotations

from torch import Tensor

TINY = 1e-12


def equalizer(query_energy: Tensor, key_energy: Tensor) -> Tensor:
    """``s`` [Hkv, D] from per-channel sums of squares of queries and keys [Hkv, D],
    scaled to a geometric mean of 1 per head (only ratios between channels matter)."""
    s = (key_energy.float().clamp_min(TINY) / query_energy.float().clamp_min(TINY)).pow(0.25)
    return s / s.log().mean(-1, keepdim=True).exp()


def divide_keys(k: Tensor, s: Tensor) -> Tensor:
    """k [..., Hkv, D] / s [Hkv, D]."""
    return k / s.to(k.dtype)


def scale_queries(q: Tensor, s: Tensor) -> Tensor:
    """q [T, H, D] times the ``s`` of each head's KV head (heads grouped as in GQA)."""
    tokens, heads, head_dim = q.shape
    kv_heads = s.shape[0]
    grouped = q.view(tokens, kv_heads, heads // kv_heads, head_dim) * s.to(q.dtype)[None, :, None, :]
    return grouped.view(tokens, heads, head_dim)
