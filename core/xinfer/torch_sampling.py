"""Sampling a batch of rows from their logits, in plain torch: the reference of
:meth:`xinfer.ops.Ops.sample`, which a backend's kernel reproduces token for token.

Row ``b`` with temperature ``T > 0`` draws from ``softmax(s)``, ``s = logits * (1 / T)``,
restricted to the tokens that pass top-k, then top-p over the top-k renormalised
distribution, then min-p, and renormalised (vLLM's order). Every filter keeps an upper
set of ``s``, ties included:

- top-k: ``s >= `` the k-th largest ``s``;
- top-p: the mass of the tokens strictly above it is ``< top_p`` of the top-k mass (the
  smallest prefix in descending probability whose mass reaches ``top_p``);
- min-p: its probability is ``>= min_p`` times the largest.

A draw is a Gumbel-max: ``argmax(s + g)``, ``g = -log(-log(u))`` with ``u`` uniform
from an integer hash of (seed, position, token, round) (:func:`noise`), the same bits in
torch and in Triton, so a row draws the same tokens whatever else is in the batch.

The filters are applied by rejection, not by sorting: round 0 draws from every token;
a candidate outside the kept set shows that nothing at or below its ``s`` is kept, so
round ``r + 1`` draws from the tokens above it (and above the k-th). Each round draws
from a superset of the kept set, so the accepted token follows the filtered softmax
exactly. Top-p accepts the first candidate with probability at least ``top_p``.
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


def noise(keys: Tensor, round: int, vocab: int) -> Tensor:
    """Gumbel noise [rows, vocab] of round ``round`` for rows of ``keys``."""
    round_keys = mix((keys + round) & MASK32)
    bits = mix(mix(torch.arange(vocab, device=keys.device)) ^ round_keys[:, None])
    uniform = ((bits >> 9).float() + 0.5) * 2.0**-23  # (0, 1), exactly
    return -torch.log(-torch.log(uniform))


def order_keys(s: Tensor) -> Tensor:
    """int32 keys that order as the floats ``s`` do (-0 as +0)."""
    bits = (s + 0.0).view(torch.int32)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def sample(logits: Tensor, params: SamplingBatch) -> Tensor:
    """Token ids [rows] drawn from ``logits`` [rows, vocab] (any float dtype)."""
    rows, vocab = logits.shape
    temperature, top_k, top_p, min_p = (
        getattr(params, f)[:rows, None] for f in ("temperature", "top_k", "top_p", "min_p")
    )
    logits = logits.float()
    greedy = logits.argmax(-1)
    s = logits * (1.0 / torch.where(temperature > 0, temperature, 1.0))
    peak = s.max(-1, keepdim=True).values
    weights = torch.exp(s - peak)
    keys = order_keys(s)
    with_top_k = (top_k > 0) & (top_k < vocab)
    floor = keys.min(-1, keepdim=True).values  # the least key kept by top-k
    if with_top_k.any():
        kth = keys.sort(-1, descending=True).values.gather(1, top_k.clamp(1, vocab) - 1)
        floor = torch.where(with_top_k, kth, floor)
    kept_mass = torch.where(keys >= floor, weights, 0.0).sum(-1, keepdim=True)
    filtered = (with_top_k | (top_p < 1) | (min_p > 0)).squeeze(1) & (temperature > 0).squeeze(1)

    row_key = row_keys(params.seed[:rows], params.position[:rows])
    drawn = (s + noise(row_key, 0, vocab)).argmax(-1, keepdim=True)
    accepted = ~filtered
    round = 0
    while not accepted.all():
        candidate = keys.gather(1, drawn)
        mass_above = torch.where(keys > candidate, weights, 0.0).sum(-1, keepdim=True)
        kept = (
            (candidate >= floor)
            & ((top_p >= 1) | (mass_above < top_p * kept_mass))
            & (torch.exp(s.gather(1, drawn) - peak) >= min_p)
        ).squeeze(1)
        accepted |= kept
        round += 1
        eligible = keys > torch.maximum(candidate, floor - 1)
        redrawn = torch.where(eligible, s + noise(row_key, round, vocab), float("-inf")).argmax(-1, keepdim=True)
        drawn = torch.where(accepted[:, None], drawn, redrawn)
    return torch.where(temperature.squeeze(1) > 0, drawn.squeeze(1), greedy)
