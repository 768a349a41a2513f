"""A batch's token draws in one launch: :func:`xinfer.torch_sampling.sample`, token for
token (same noise bits, same rejection rounds), one program per row.

Passes over a row's logits, each a stream of its ``vocab`` values (the last ones read
back from L2 where the row still is there):

- greedy rows: one (the argmax);
- every sampled row: one online pass for the peak and the softmax mass of ``s = l / T``,
  the least ``s`` and the round-0 Gumbel-max draw; without filters that draw is the token;
- top-k: a threshold search over the order-preserving integer keys of ``s``, ``PIVOTS``
  thresholds per pass (each pass narrows the range ``PIVOTS + 1`` times: about 7 passes
  for 32-bit keys), counting and weighing what lies above each, until the k-th largest
  key and the top-k mass are known exactly;
- top-p / min-p / top-k: one pass per rejection round, which both weighs the mass above
  the candidate (to accept it) and draws the next round's candidate above it (in case it
  is not). Top-p accepts the first candidate with probability >= top_p, so top-p rows
  take about two passes in all.

No sort, no host synchronisation, no per-row launches: a step's sampling is one kernel
inside the step's CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.sampling import SamplingBatch
from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

BLOCK = 2048  # logits per iteration of a streaming pass
SEARCH_BLOCK = 256  # per iteration of a top-k search pass (times PIVOTS comparisons)
PIVOTS = 16


@triton.jit
def _mix(x):
    """The 32-bit hash of :func:`xinfer.torch_sampling.mix` on uint32."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _gumbel(round_key, tokens):
    bits = _mix(_mix(tokens.to(tl.uint32)) ^ round_key)
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23
    return -tl.log(-tl.log(uniform))


@triton.jit
def _order_key(s):
    bits = (s + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _greedy(row_ptr, vocab, BLOCK: tl.constexpr):
    best = tl.full((), float("-inf"), tl.float32)
    best_token = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32)
        peak = tl.max(logits, 0)
        take = peak > best  # strictly: the first maximum wins
        best_token = tl.where(take, start + tl.argmax(logits, 0, tie_break_left=True), best_token)
        best = tl.where(take, peak, best)
    return best_token


@triton.jit
def _top_k_floor(row_ptr, vocab, inv_t, peak, least, total, top_k, SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """The k-th largest key of ``s`` and the mass at or above it."""
    lo = _order_key(least).to(tl.int64)  # at least k keys at or above lo, fewer than k at or above hi
    hi = _order_key(peak).to(tl.int64) + 1
    mass_lo = total
    steps = tl.arange(0, PIVOTS).to(tl.int64) + 1
    while hi - lo > 1:
        pivots = lo + ((hi - lo) * steps) // (PIVOTS + 1)
        counts = tl.zeros((PIVOTS,), tl.int32)
        masses = tl.zeros((PIVOTS,), tl.float32)
        for start in range(0, vocab, SEARCH_BLOCK):
            tokens = start + tl.arange(0, SEARCH_BLOCK)
            valid = tokens < vocab
            s = tl.load(row_ptr + tokens, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            weights = tl.where(valid, tl.exp(s - peak), 0.0)
            above = (_order_key(s).to(tl.int64)[:, None] >= pivots[None, :]) & valid[:, None]
            counts += tl.sum(above.to(tl.int32), 0)
            masses += tl.sum(tl.where(above, weights[:, None], 0.0), 0)
        enough = counts >= top_k
        new_lo = tl.max(tl.where(enough, pivots, lo), 0)
        mass_lo = tl.where(new_lo > lo, tl.max(tl.where(enough & (pivots == new_lo), masses, 0.0), 0), mass_lo)
        hi = tl.min(tl.where(enough, hi, pivots), 0)
        lo = new_lo
    return lo.to(tl.int32), mass_lo


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride,
    vocab,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    position_ptr,
    out_ptr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    temperature = tl.load(temperature_ptr + row)
    if temperature == 0.0:
        tl.store(out_ptr + row, _greedy(row_ptr, vocab, BLOCK).to(tl.int64))
    else:
        inv_t = 1.0 / temperature
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        min_p = tl.load(min_p_ptr + row)
        seed = tl.load(seed_ptr + row)
        position = tl.load(position_ptr + row)
        low, high = (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        key = _mix(_mix(_mix(low) ^ high) ^ (position & 0xFFFFFFFF).to(tl.uint32))

        # pass 1: peak, mass, least s, and the round-0 draw (online softmax)
        peak = tl.full((), float("-inf"), tl.float32)
        total = tl.full((), 0.0, tl.float32)
        least = tl.full((), float("inf"), tl.float32)
        best = tl.full((), float("-inf"), tl.float32)
        draw = tl.full((), 0, tl.int32)
        round_key = _mix(key)
        for start in range(0, vocab, BLOCK):
            tokens = start + tl.arange(0, BLOCK)
            valid = tokens < vocab
            s = tl.load(row_ptr + tokens, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
            new_peak = tl.maximum(peak, tl.max(s, 0))
            rescale = tl.where(new_peak == float("-inf"), 0.0, tl.exp(peak - new_peak))
            total = total * rescale + tl.sum(tl.where(valid, tl.exp(s - new_peak), 0.0), 0)
            peak = new_peak
            least = tl.minimum(least, tl.min(tl.where(valid, s, float("inf")), 0))
            score = tl.where(valid, s + _gumbel(round_key, tokens), float("-inf"))
            take = tl.max(score, 0) > best
            draw = tl.where(take, start + tl.argmax(score, 0), draw)
            best = tl.where(take, tl.max(score, 0), best)

        with_top_k = (top_k > 0) & (top_k < vocab)
        if with_top_k | (top_p < 1.0) | (min_p > 0.0):
            floor = _order_key(least)
            kept_mass = total
            if with_top_k:
                floor, kept_mass = _top_k_floor(row_ptr, vocab, inv_t, peak, least, total, top_k, SEARCH_BLOCK, PIVOTS)
            drawn_s = tl.load(row_ptr + draw).to(tl.float32) * inv_t
            drawn_key = _order_key(drawn_s)
            done = tl.full((), 0, tl.int32)
            round = 0
            while done == 0:
                # one pass: the mass above the candidate, and the next round's candidate above it
                round += 1
                round_key = _mix(key + round)
                eligible_above = tl.maximum(drawn_key, floor - 1)
                mass_above = tl.full((), 0.0, tl.float32)
                best = tl.full((), float("-inf"), tl.float32)
                redraw = tl.full((), 0, tl.int32)
                for start in range(0, vocab, BLOCK):
                    tokens = start + tl.arange(0, BLOCK)
                    valid = tokens < vocab
                    s = tl.load(row_ptr + tokens, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
                    keys = _order_key(s)
                    mass_above += tl.sum(tl.where(valid & (keys > drawn_key), tl.exp(s - peak), 0.0), 0)
                    score = tl.where(valid & (keys > eligible_above), s + _gumbel(round_key, tokens), float("-inf"))
                    take = tl.max(score, 0) > best
                    redraw = tl.where(take, start + tl.argmax(score, 0), redraw)
                    best = tl.where(take, tl.max(score, 0), best)
                accepted = (
                    (drawn_key >= floor)
                    & ((top_p >= 1.0) | (mass_above < top_p * kept_mass))
                    & (tl.exp(drawn_s - peak) >= min_p)
                )
                draw = tl.where(accepted, draw, redraw)
                done = accepted.to(tl.int32)
                drawn_s = tl.load(row_ptr + draw).to(tl.float32) * inv_t
                drawn_key = _order_key(drawn_s)
        tl.store(out_ptr + row, draw.to(tl.int64))


def sample(logits: Tensor, params: SamplingBatch) -> Tensor:
    """Token ids [rows] drawn from ``logits`` [rows, vocab] (see :meth:`xinfer.ops.Ops.sample`)."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    _sample_kernel[(rows,)](
        logits,
        logits.stride(0),
        vocab,
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.seed,
        params.position,
        tokens,
        BLOCK=min(BLOCK, triton.next_power_of_2(vocab)),
        SEARCH_BLOCK=min(SEARCH_BLOCK, triton.next_power_of_2(vocab)),
        PIVOTS=PIVOTS,
        num_warps=8,
        **launch.pdl(logits.device),
    )
    return tokens
