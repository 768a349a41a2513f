"""Sampling a batch of rows from their logits, in plain torch: the reference of
:meth:`xinfer.ops.Ops.sample`, which a backend's kernel reproduces token for token.

Row ``b`` with temperature ``T > 0`` draws from ``softmax(s)``, ``s = logits * (1 / T)``,
restricted to the tokens that pass top-k, then top-p over the top-k renormalised
distribution, then min-p, and renormalised (the order of transformers' warpers). Every
filter keeps an upper set of ``s``, ties included:

- top-k: ``s >= `` the k-th largest ``s``;
- top-p: the mass of the tokens strictly above it is ``< top_p`` of the top-k mass (the
  smallest prefix in descending probability whose mass reaches ``top_p``);
- min-p: its probability is ``>= min_p`` times the largest.

A draw is a Gumbel-max over the kept tokens: ``argmax(s + g)``, ``g = -log(-log(u))``
with ``u`` uniform from an integer hash of (seed, position, token) (:func:`noise`), the
same bits in torch and in Triton, so a row draws the same tokens whatever else is in
the batch. The kept set does not depend on the noise, so the draw follows the filtered
softmax exactly; a kernel finds the set's least ``s`` without sorting.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.sampling import SamplingBatch

MASK32 = 0xFFFFFFFF
# Multipliers of a two-round multiply-xorshift 32-bit hash (from Chris Wellons'
# hash-prospector); below 2**31, so that torch computes them exactly in int64.
MIX1, MIX2 = 0x21F0AAAD, 0x735A2D97


def mix(x: Tensor) -> Tensor:
    """A 32-bit integer hash (a bijection) of ``x`` in [0, 2**32), held in int64."""
    x = x ^ (x >> 16)
    x = (x * MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX2) & MASK32
    return x ^ (x >> 15)


def row_keys(seed: Tensor, position: Tensor) -> Tensor:
    """One 32-bit key per row from its int64 seed and position."""
    low, high = seed & MASK32, (seed >> 32) & MASK32
    return mix(mix(mix(low) ^ high) ^ (position & MASK32))


def noise(keys: Tensor, vocab: int) -> Tensor:
    """Gumbel noise [rows, vocab] for rows of ``keys``."""
    return noise_at(keys, torch.arange(vocab, device=keys.device))


def noise_at(keys: Tensor, tokens: Tensor) -> Tensor:
    """The Gumbel noise of :func:`noise` at ``tokens`` only ([vocab], or [rows, n] per row)."""
    bits = mix(mix(tokens) ^ mix(keys)[:, None])
    uniform = ((bits >> 9).float() + 0.5) * 2.0**-23  # (0, 1), exactly
    return -torch.log(-torch.log(uniform))


def order_keys(s: Tensor) -> Tensor:
    """int32 keys that order as the floats ``s`` do (-0 as +0)."""
    bits = (s + 0.0).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def mass_above(keys: Tensor, weights: Tensor) -> Tensor:
    """Per token, the summed ``weights`` of the tokens with a strictly larger key (summed
    from the largest down)."""
    ascending, order = keys.sort(-1)
    from_top = weights.gather(-1, order).flip(-1).cumsum(-1).flip(-1)  # [j]: the sum over ascending[j:]
    suffix = torch.cat([from_top, torch.zeros_like(from_top[:, :1])], -1)
    return suffix.gather(-1, torch.searchsorted(ascending, keys, right=True))


def sample(logits: Tensor, params: SamplingBatch) -> Tensor:
    """Token ids [rows] drawn from ``logits`` [rows, vocab] (any float dtype)."""
    rows, vocab = logits.shape
    temperature, top_k, top_p, min_p = (
        getattr(params, f)[:rows, None] for f in ("temperature", "top_k", "top_p", "min_p")
    )
    if not (temperature > 0).any():  # every row greedy: no filter or noise to compute
        return logits.argmax(-1)
    logits = logits.float()
    s = logits * (1.0 / torch.where(temperature > 0, temperature, 1.0))
    weights = torch.exp(s - s.max(-1, keepdim=True).values)
    keys = order_keys(s)
    kept = weights >= min_p
    in_top_k = torch.ones_like(kept)
    with_top_k = (top_k > 0) & (top_k < vocab)
    if with_top_k.any():
        kth = keys.sort(-1, descending=True).values.gather(1, top_k.clamp(1, vocab) - 1)
        in_top_k = ~with_top_k | (keys >= kth)
    kept &= in_top_k
    if (top_p < 1).any():
        top_k_mass = torch.where(in_top_k, weights, 0.0).sum(-1, keepdim=True)
        kept &= (top_p >= 1) | (mass_above(keys, weights) < top_p * top_k_mass)
    row_key = row_keys(params.seed[:rows], params.position[:rows])
    drawn = torch.where(kept, s + noise(row_key, vocab), float("-inf")).argmax(-1)
    return torch.where(temperature.squeeze(1) > 0, drawn, logits.argmax(-1))
