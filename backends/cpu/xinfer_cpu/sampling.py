"""The reference's draw (:func:`xinfer.torch_sampling.sample`), token for token, without sorting the
vocabulary when every sampling row has a top-p.

The top-p set of a row is its largest tokens up to a mass, usually a few dozen of them: the
reference finds it with a sort of the whole vocabulary and a search per token (most of a step's
time at 32 rows on a CPU). Here each row's ``width`` largest tokens are the candidates; when the
last of them is outside top-p, so is every other token (its mass above is at least the last
one's), and the kept set, its noise and the draw are computed over the candidates alone. A row
whose candidates do not reach its top-p mass tries more of them (the rows still to draw alone), then
the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer import torch_sampling
from xinfer.sampling import SamplingBatch
from xinfer.torch_sampling import mass_above, noise_at, order_keys, row_keys

CANDIDATES = (64, 1024)


def sample(logits: Tensor, params: SamplingBatch) -> Tensor:
    rows, vocab = logits.shape
    temperature, top_k, top_p, min_p = (
        getattr(params, f)[:rows, None] for f in ("temperature", "top_k", "top_p", "min_p")
    )
    sampled = temperature > 0
    if not sampled.any() or not (~sampled | ((top_p > 0) & (top_p < 1))).all():
        return torch_sampling.sample(logits, params)
    logits = logits.float()
    s = logits * (1.0 / torch.where(sampled, temperature, 1.0))
    weights = torch.exp(s - s.max(-1, keepdim=True).values)
    with_top_k = (top_k > 0) & (top_k < vocab)
    largest_k = int(torch.where(with_top_k, top_k, 0).max())
    greedy = not sampled.all()
    tokens_drawn = logits.argmax(-1) if greedy else torch.zeros(rows, dtype=torch.long)  # the greedy rows' tokens
    pending = sampled.squeeze(1)  # rows still to draw
    rows_in: slice | Tensor = slice(None)  # the rows of this round: every row, then the pending ones alone
    top_k_mass = weights.sum(-1, keepdim=True)  # (rows with a top-k: below, from the first candidates)
    for round, width in enumerate(CANDIDATES):
        width = max(width, largest_k)  # every row's k-th largest among the candidates
        if width >= vocab:
            break
        top_s, tokens = s[rows_in].topk(width, dim=-1)  # descending
        keys = order_keys(top_s)
        row_top_k = top_k[rows_in]
        kth = keys.gather(1, (row_top_k - 1).clamp(0, width - 1))  # (rows without top-k: unused)
        in_top_k = ~with_top_k[rows_in] | (keys >= kth)
        if round == 0 and largest_k:  # the first round has every row
            top_k_mass = torch.where(~with_top_k | (order_keys(s) >= kth), weights, 0.0).sum(-1, keepdim=True)
        mass = top_k_mass[rows_in]
        top_weights = weights[rows_in].gather(1, tokens)
        above = mass_above(keys, top_weights)
        held = pending[rows_in] & (above[:, -1] >= top_p[rows_in].squeeze(1) * mass.squeeze(1))  # the last one is out
        kept = (top_weights >= min_p[rows_in]) & in_top_k & (above < top_p[rows_in] * mass)
        noise = noise_at(row_keys(params.seed[:rows][rows_in], params.position[:rows][rows_in]), tokens)
        drawn = torch.where(kept, top_s + noise, float("-inf"))
        best = drawn.max(-1, keepdim=True).values
        first = torch.where(drawn == best, tokens, vocab).min(-1).values  # the reference's argmax: the lowest id
        tokens_drawn[rows_in] = torch.where(held, first, tokens_drawn[rows_in])
        pending[rows_in] &= ~held
        if not pending.any():
            return tokens_drawn
        rows_in = pending.nonzero().squeeze(1)
    rest = pending.nonzero().squeeze(1)  # rows whose top-p set the candidates do not hold
    tokens_drawn[rest] = torch_sampling.sample(logits[rest], _rows_of(params, rest))
    return tokens_drawn


def _rows_of(params: SamplingBatch, rows: Tensor) -> SamplingBatch:
    subset = SamplingBatch.empty(len(rows))
    for name in SamplingBatch.INTS + SamplingBatch.FLOATS:
        getattr(subset, name).copy_(getattr(params, name)[rows])
    return subset
