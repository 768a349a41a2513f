"""A batch's token draws: :func:`xinfer.torch_sampling.sample`, token for token (same
noise bits, the noise within 4e-6 of the reference's float32 values, same kept sets), with
each row split over chunks of ``CHUNK`` tokens so that one row alone still spreads over
the GPU.

The noise of a token is fixed by (seed, position, token), so the draw over the kept set
``K`` is the Gumbel-max ``argmax_K(s + g)``, and ``K`` is an upper set of ``s``. Hence the
candidate ``t1 = argmax(s + g)`` over the whole row *is* the draw whenever ``t1`` is kept
(``K`` is part of the row); that needs only the count and mass of the tokens above it,
and it is so with probability ``mass(K)``: 95 % of the rows at top-p 0.95, every constant
row. A row whose candidate is not kept has its cut above it, so the exact search that
settles it looks only at the tokens above a floor (the candidate or a probe below the
k-th token, whichever is higher; the probe alone when top-p needs the top-k mass), and
its atomics and boundary are those few. Six launches; two passes over the logits for a
row its candidate settles, two more over a row it does not:

1. stats (rows x chunks): per chunk, greedy rows their argmax, sampled rows their
   Gumbel-max draw (the token of a row without filters, the candidate of the others);
   filtered rows the peak, softmax mass and least of ``s = l / T``;
2. check (rows x chunks; rows with top-k or top-p): per chunk, the count and mass of
   the tokens above the candidate, the mass of its ties and, with top-k, the counts
   above a few probes around it (the highest with k tokens above is below the k-th);
3. histogram (rows x chunks; rows the candidate does not settle): each chunk's count (for
   top-k) and mass (for top-p) of the ``s`` above the floor in ``BUCKETS`` buckets below
   the row's peak, added atomically to the row's, and the chunk's whole mass; masses are
   integers (a token weighs ``exp(s - peak)`` in units of 2**-32, rounded), so every sum
   is exact whatever the order of the atomics, and every later pass weighs a token alike;
4. plan (rows; only the histogram): whether the candidate settles the row, else the
   bucket of the k-th token and the bucket where the top-p cut falls: the boundary. The
   masses are exact, so with top-p alone the boundary is the one bucket the cut is in
   (with top-k too, the few the top-k mass's bounds leave);
5. draw (rows x chunks; unsettled rows): the Gumbel-max over the tokens above the
   boundary (all kept, but for min-p, which is one comparison), the boundary's token ids
   gathered (tens to a few hundred of a 248k row at top-p 0.95), their least and largest
   keys and their own Gumbel-max;
6. settle (rows): the candidate, or the exact cuts among the boundary tokens (a
   threshold search over their order-preserving integer keys, from the plan's integer
   masses above the boundary) and the draw over the kept ones.

The boundary holds the tokens of a bucket (1/4096 of the row's range of ``s``): tens to
hundreds of a smooth row, more where logits tie (in bfloat16 a value is shared by up to a
few thousand tokens of a large vocabulary: about 2,400 at 248k with the bulk at 10 +- 2,
where the spacing is 1/16). The settle passes over them twice when they tie, about ten
times when their keys differ. A boundary of more than ``REGION`` tokens that all tie is
kept or dropped whole, from the plan's masses (its draw is the draw pass's); one of
several keys (over 8,192 tokens, not all equal, within 1/4096 of the row's range) is settled
by the same search over the whole row, in one program: slower, never wrong. No sort, no
host synchronisation: a step's sampling is recorded in the step's CUDA graph. The chunk
size is fixed, so a row's sums, and so its tokens, do not depend on the batch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import libdevice

from xinfer.sampling import SamplingBatch
from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry

CHUNK = 4096  # tokens of a row per program
BLOCK = 1024  # tokens per iteration of a streaming pass
BUCKETS = 4096
REGION = 8192  # boundary tokens gathered per row (memory only); a row with more searches its whole row
SPREAD = 32.0  # buckets cover at most this much of s below the peak (exp(-32): no mass)
SEARCH_BLOCK = 128  # boundary tokens per iteration of a threshold search (times PIVOTS)
PIVOTS = 16
PROBES = 8  # values around a top-k row's candidate where its check counts the tokens above
SLACK = 1e-4  # relative, on the least weight in the k-th token's bucket: exp's rounding
FIXED = tl.constexpr(4294967296.0)  # 2**32: integer weights, exp(s - peak) in units of 2**-32
INT32_MAX = tl.constexpr(2147483647)
INT32_MIN = tl.constexpr(-2147483648)
ONE_LESS_HALF_ULP = tl.constexpr(1.0 - 2.0**-24)
# the hardware's approximate logarithm on a GPU; under the interpreter, which has no libdevice, the exact one
FAST_LOG = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def _mix(x):
    """The 32-bit hash of :func:`xinfer.torch_sampling.mix` on uint32."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def _log(x):
    if FAST_LOG:
        return libdevice.fast_logf(x)  # lg2.approx: absolute error about 2**-22 on log2
    else:
        return tl.log(x)


@triton.jit
def _gumbel(noise_key, tokens):
    """The reference's noise, within 4e-6 (a few units in the last place): the draw of every
    token of a row costs most of a pass, so its two logarithms are the hardware's
    approximate one, with ``-log(u)`` for ``u`` near 1 (where that one loses the digits)
    from its series in ``1 - u``."""
    bits = _mix(_mix(tokens.to(tl.uint32)) ^ noise_key)
    # the reference's ((bits >> 9) + 0.5) * 2**-23 exactly, without a conversion: (1 + k 2**-23) - (1 - 2**-24)
    uniform = ((bits >> 9) | 0x3F800000).to(tl.float32, bitcast=True) - ONE_LESS_HALF_ULP
    gap = 1.0 - uniform  # exact where it is used, u >= 7/8
    series = gap * tl.fma(
        gap, tl.fma(gap, tl.fma(gap, tl.fma(gap, tl.fma(gap, 1.0 / 6.0, 0.2), 0.25), 1.0 / 3.0), 0.5), 1.0
    )
    return -_log(tl.where(gap < 0.125, series, -_log(uniform)))


@triton.jit
def _noise_key(seed_ptr, position_ptr, row):
    seed = tl.load(seed_ptr + row)
    position = tl.load(position_ptr + row)
    low, high = (seed & 0xFFFFFFFF).to(tl.uint32), ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return _mix(_mix(_mix(_mix(low) ^ high) ^ (position & 0xFFFFFFFF).to(tl.uint32)))


@triton.jit
def _order_key(s):
    bits = (s + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _bucket(s, peak, inv_width, BUCKETS: tl.constexpr):
    depth = (peak - s) * inv_width
    return tl.where(depth < BUCKETS - 1.0, depth, BUCKETS - 1.0).to(tl.int32)  # NaN (a row of -inf) too


@triton.jit
def _params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr):
    return tl.load(temperature_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row), tl.load(min_p_ptr + row)


@triton.jit
def _with_top_k(temperature, top_k, vocab):
    return (temperature > 0.0) & (top_k > 0) & (top_k < vocab)


@triton.jit
def _with_top_p(temperature, top_p):
    return (temperature > 0.0) & (top_p < 1.0)


@triton.jit
def _filtered(temperature, top_k, top_p, min_p, vocab):
    return (
        _with_top_k(temperature, top_k, vocab) | _with_top_p(temperature, top_p) | ((temperature > 0.0) & (min_p > 0.0))
    )


@triton.jit
def _take(best, best_token, scores, tokens):
    """The running best (score, token) after a block: the larger score, the lower token on ties."""
    top = tl.max(scores, 0)
    token = tl.min(tl.where(scores == top, tokens, INT32_MAX), 0)
    take = (top > best) | ((top == best) & (token < best_token))
    return tl.where(take, top, best), tl.where(take, token, best_token)


@triton.jit
def _stats_kernel(
    logits_ptr, stride, vocab,
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr,
    stats_ptr, best_ptr, best_token_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    row, chunk, chunks = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)
    temperature, top_k, top_p, min_p = _params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr)
    filtered = _filtered(temperature, top_k, top_p, min_p, vocab)
    draws = temperature > 0.0
    inv_t = 1.0 / tl.where(temperature > 0.0, temperature, 1.0)
    noise_key = _noise_key(seed_ptr, position_ptr, row)
    peak = tl.full((), float("-inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    least = tl.full((), float("inf"), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_token = chunk * CHUNK
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        valid = tokens < vocab
        s = tl.load(logits_ptr + row * stride + tokens, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
        if filtered:  # the plan's statistics
            new_peak = tl.maximum(peak, tl.max(s, 0))
            rescale = tl.where(new_peak == float("-inf"), 0.0, tl.exp(peak - new_peak))
            total = total * rescale + tl.sum(tl.where(s == float("-inf"), 0.0, tl.exp(s - new_peak)), 0)
            peak = new_peak
            least = tl.minimum(least, tl.min(tl.where(s == float("-inf"), float("inf"), s), 0))
        if draws:  # the token, or the candidate
            scores = tl.where(valid, s + _gumbel(noise_key, tokens), float("-inf"))
        else:
            scores = s
        best, best_token = _take(best, best_token, scores, tokens)
    stats = stats_ptr + (row * chunks + chunk) * 3
    tl.store(stats, peak)
    tl.store(stats + 1, total)
    tl.store(stats + 2, least)
    tl.store(best_ptr + row * chunks + chunk, best)
    tl.store(best_token_ptr + row * chunks + chunk, best_token)


@triton.jit
def _candidate(best_ptr, best_token_ptr, row, chunks, CHUNKS: tl.constexpr):
    """The row's best token over its chunks' (the larger score, the lower token on ties)."""
    chunk = tl.arange(0, CHUNKS)
    part_best = tl.load(best_ptr + row * chunks + chunk, mask=chunk < chunks, other=float("-inf"))
    part_token = tl.load(best_token_ptr + row * chunks + chunk, mask=chunk < chunks, other=INT32_MAX)
    return tl.min(tl.where(part_best == tl.max(part_best, 0), part_token, INT32_MAX), 0)


@triton.jit
def _probes(s1, least, peak, PROBES: tl.constexpr):
    """Values where a top-k row's check counts the tokens above: half below ``s1``, at 1/2,
    1/4, .. of the way down to the least ``s``, half above, as far up towards the peak."""
    i = tl.arange(0, PROBES)
    below = i < PROBES // 2
    depth = tl.exp2(-(tl.where(below, i, i - PROBES // 2) + 1).to(tl.float32))
    down = tl.where(least < s1, s1 - least, 0.0)
    return tl.where(below, s1 - down * depth, peak - (peak - s1) * depth)


@triton.jit
def _check_kernel(
    logits_ptr, stride, vocab,
    temperature_ptr, top_k_ptr, top_p_ptr,
    stats_ptr, best_ptr, best_token_ptr, checks_ptr, chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PROBES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per chunk of a row with top-k or top-p: the count and mass of the tokens above its
    candidate ``t1``, the mass of the tokens tied with it, and with top-k the counts above
    each of :func:`_probes`."""
    pdl_entry(PDL)
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    temperature, top_k, top_p = tl.load(temperature_ptr + row), tl.load(top_k_ptr + row), tl.load(top_p_ptr + row)
    with_top_k = _with_top_k(temperature, top_k, vocab)
    if with_top_k | _with_top_p(temperature, top_p):
        peak, _, least = _row_stats(stats_ptr, row, chunks, CHUNKS)
        inv_t = 1.0 / temperature
        row_ptr = logits_ptr + row * stride
        s1 = tl.load(row_ptr + _candidate(best_ptr, best_token_ptr, row, chunks, CHUNKS)).to(tl.float32) * inv_t
        probes = _probes(s1, least, peak, PROBES)
        count = tl.zeros((BLOCK,), tl.int32)  # per lane, summed once at the end
        mass = tl.zeros((BLOCK,), tl.float32)
        ties = tl.zeros((BLOCK,), tl.float32)
        probe_counts = tl.zeros((PROBES,), tl.int32)
        for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
            tokens = start + tl.arange(0, BLOCK)
            s = tl.load(row_ptr + tokens, mask=tokens < vocab, other=float("-inf")).to(tl.float32) * inv_t
            weights = tl.where(s == float("-inf"), 0.0, tl.exp(s - peak))
            count += (s > s1).to(tl.int32)
            mass += tl.where(s > s1, weights, 0.0)
            ties += tl.where(s == s1, weights, 0.0)
            if with_top_k:
                probe_counts += tl.sum((s[:, None] > probes[None, :]).to(tl.int32), 0)
        checks = checks_ptr + (row * chunks + chunk) * (3 + PROBES)
        tl.store(checks, tl.sum(count, 0).to(tl.float32))  # exact: below 2**24
        tl.store(checks + 1, tl.sum(mass, 0))
        tl.store(checks + 2, tl.sum(ties, 0))
        tl.store(checks + 3 + tl.arange(0, PROBES), probe_counts.to(tl.float32))


@triton.jit
def _verdict(
    logits_ptr, stride, vocab, row, temperature, top_k, top_p, min_p,
    stats_ptr, best_ptr, best_token_ptr, checks_ptr, chunks,
    CHUNKS: tl.constexpr, PROBES: tl.constexpr,
):  # fmt: skip
    """Of a filtered row: whether its candidate ``t1`` is kept (then it is the draw), and
    else the floor above which the exact search looks. The cut is above ``s1`` and, with
    top-k, above the highest probe with k tokens above it: the floor is the higher of
    the two, but for top-p with the k-th token at or below ``s1``, where top-p needs the
    top-k mass: then that probe alone (-inf if none)."""
    with_top_k, with_top_p = _with_top_k(temperature, top_k, vocab), _with_top_p(temperature, top_p)
    peak, total, least = _row_stats(stats_ptr, row, chunks, CHUNKS)
    s1 = tl.load(logits_ptr + row * stride + _candidate(best_ptr, best_token_ptr, row, chunks, CHUNKS))
    s1 = s1.to(tl.float32) * (1.0 / temperature)
    kept = tl.exp(s1 - peak) >= min_p
    floor = s1
    if with_top_k | with_top_p:
        chunk = tl.arange(0, CHUNKS)
        checks = checks_ptr + (row * chunks + chunk) * (3 + PROBES)
        count = tl.sum(tl.load(checks, mask=chunk < chunks, other=0.0), 0)
        mass = tl.sum(tl.load(checks + 1, mask=chunk < chunks, other=0.0), 0)
        ties = tl.sum(tl.load(checks + 2, mask=chunk < chunks, other=0.0), 0)
        in_top_k = ~with_top_k | (count < top_k)
        # with top-k, the top-k mass is unknown but holds every token from t1 up
        top_k_mass = tl.where(with_top_k, mass + ties, total)
        kept = kept & in_top_k & (~with_top_p | (mass < top_p * top_k_mass))
        if with_top_k:
            probe_counts = tl.load(
                checks[:, None] + 3 + tl.arange(0, PROBES)[None, :], mask=(chunk < chunks)[:, None], other=0.0
            )
            below_kth = tl.sum(probe_counts, 0) >= top_k
            floor_k = tl.max(tl.where(below_kth, _probes(s1, least, peak, PROBES), float("-inf")), 0)
            floor = tl.where(with_top_p & in_top_k, floor_k, tl.maximum(s1, floor_k))
    return kept, floor


@triton.jit
def _row_stats(stats_ptr, row, chunks, CHUNKS: tl.constexpr):
    """The row's peak, softmax mass (relative to the peak) and least finite s, from its chunks'."""
    chunk = tl.arange(0, CHUNKS)
    stats = stats_ptr + (row * chunks + chunk) * 3
    part_peak = tl.load(stats, mask=chunk < chunks, other=float("-inf"))
    peak = tl.max(part_peak, 0)
    part_total = tl.load(stats + 1, mask=chunk < chunks, other=0.0)
    total = tl.sum(tl.where(part_peak == float("-inf"), 0.0, part_total * tl.exp(part_peak - peak)), 0)
    least = tl.min(tl.load(stats + 2, mask=chunk < chunks, other=float("inf")), 0)
    return peak, total, least


@triton.jit
def _inv_width(peak, floor, BUCKETS: tl.constexpr, SPREAD: tl.constexpr):
    return BUCKETS / tl.maximum(tl.minimum(peak - floor, SPREAD), 1e-30)


@triton.jit
def _fixed_weight(s, peak):
    """exp(s - peak) in units of 2**-32, rounded: integer sums do not depend on their order,
    and every pass weighs a token alike."""
    return tl.where(s == float("-inf"), 0, (tl.exp(s - peak) * FIXED + 0.5).to(tl.int64))


@triton.jit
def _above(s, floor):
    """``s`` of the tokens above the floor, -inf for the rest: they are neither kept nor
    weighed by the exact search (the cut is above the floor)."""
    return tl.where(s > floor, s, float("-inf"))


@triton.jit
def _histogram_kernel(
    logits_ptr, stride, vocab,
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    stats_ptr, best_ptr, best_token_ptr, checks_ptr, histogram_ptr, chunk_mass_ptr, chunks,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, PROBES: tl.constexpr,
    BUCKETS: tl.constexpr, SPREAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per chunk of a row with top-k or top-p that its candidate does not settle: its count
    and integer mass per bucket of the ``s`` above the floor below the row's peak, added to
    the row's, and its whole integer mass (integer sums: exact, whatever the order). Only
    top-k needs the counts and only top-p the masses: one atomic per token but with both."""
    pdl_entry(PDL)
    row, chunk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    temperature, top_k, top_p, min_p = _params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr)
    with_top_k, with_top_p = _with_top_k(temperature, top_k, vocab), _with_top_p(temperature, top_p)
    if with_top_k | with_top_p:
        kept, floor = _verdict(
            logits_ptr, stride, vocab, row, temperature, top_k, top_p, min_p,
            stats_ptr, best_ptr, best_token_ptr, checks_ptr, chunks, CHUNKS, PROBES,
        )  # fmt: skip
        if not kept:
            peak, _, least = _row_stats(stats_ptr, row, chunks, CHUNKS)
            inv_width = _inv_width(peak, tl.maximum(least, floor), BUCKETS, SPREAD)
            inv_t = 1.0 / temperature
            counts = histogram_ptr + row * 2 * BUCKETS
            masses = counts + BUCKETS
            # the last bucket's, most of a peaked row: one atomic per chunk
            deepest_count = tl.full((), 0, tl.int64)
            deepest_mass = tl.full((), 0, tl.int64)
            chunk_mass = tl.full((), 0, tl.int64)
            for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
                tokens = start + tl.arange(0, BLOCK)
                valid = tokens < vocab
                s = tl.load(logits_ptr + row * stride + tokens, mask=valid, other=float("-inf")).to(tl.float32) * inv_t
                weights = _fixed_weight(s, peak)
                chunk_mass += tl.sum(weights, 0)
                s = _above(s, floor)
                bucket = _bucket(s, peak, inv_width, BUCKETS)
                counted = s > float("-inf")
                deep = bucket == BUCKETS - 1
                if with_top_k:
                    tl.atomic_add(counts + bucket, tl.full((BLOCK,), 1, tl.int64), mask=counted & ~deep, sem="relaxed")
                if with_top_p:
                    tl.atomic_add(masses + bucket, weights, mask=counted & ~deep, sem="relaxed")
                deepest_count += tl.sum((counted & deep).to(tl.int64), 0)
                deepest_mass += tl.sum(tl.where(counted & deep, weights, 0), 0)
            tl.atomic_add(counts + BUCKETS - 1, deepest_count, sem="relaxed")
            tl.atomic_add(masses + BUCKETS - 1, deepest_mass, sem="relaxed")
            tl.store(chunk_mass_ptr + row * chunks + chunk, chunk_mass)


@triton.jit
def _plan_kernel(
    logits_ptr, stride, vocab, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
    stats_ptr, best_ptr, best_token_ptr, checks_ptr, histogram_ptr, chunk_mass_ptr, plan_ptr, bounds_ptr, masses_ptr,
    chunks,
    CHUNKS: tl.constexpr, PROBES: tl.constexpr, BUCKETS: tl.constexpr, SPREAD: tl.constexpr,
    SLACK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per row: whether its candidate settles it (or it is not filtered); else peak, 1 / bucket
    width, floor, the buckets of the boundary: ``kth`` (the k-th token's, or BUCKETS) and
    ``[p_lo, p_hi]`` (where the top-p cut may be; above both every token is kept, below
    none), the count above kth and the integer masses above p_lo, above kth, of the row and
    of the top-k set if it keeps the whole kth bucket."""
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    temperature, top_k, top_p, min_p = _params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr)
    with_top_k, with_top_p = _with_top_k(temperature, top_k, vocab), _with_top_p(temperature, top_p)
    bounds = bounds_ptr + row * 8
    if _filtered(temperature, top_k, top_p, min_p, vocab):
        kept, floor = _verdict(
            logits_ptr, stride, vocab, row, temperature, top_k, top_p, min_p,
            stats_ptr, best_ptr, best_token_ptr, checks_ptr, chunks, CHUNKS, PROBES,
        )  # fmt: skip
        peak, _, least = _row_stats(stats_ptr, row, chunks, CHUNKS)
        inv_width = _inv_width(peak, tl.maximum(least, floor), BUCKETS, SPREAD)
        kth = tl.full((), BUCKETS, tl.int32)
        p_lo = tl.full((), BUCKETS, tl.int32)
        p_hi = tl.full((), BUCKETS - 1, tl.int32)
        above_kth = tl.full((), 0, tl.int64)
        above_p_lo_mass = tl.full((), 0, tl.int64)
        above_kth_mass = tl.full((), 0, tl.int64)
        row_mass = tl.full((), 0, tl.int64)
        whole_kth_mass = tl.full((), 0, tl.int64)
        if (with_top_k | with_top_p) & ~kept:
            chunk = tl.arange(0, CHUNKS)
            row_mass = tl.sum(tl.load(chunk_mass_ptr + row * chunks + chunk, mask=chunk < chunks, other=0), 0)
            histogram = histogram_ptr + row * 2 * BUCKETS + tl.arange(0, BUCKETS)
            kth, p_lo, p_hi, above_kth, above_p_lo_mass, above_kth_mass, whole_kth_mass = _boundary(
                tl.load(histogram), tl.load(histogram + BUCKETS), 1.0 / inv_width, row_mass,
                top_k, top_p, with_top_k, with_top_p, BUCKETS, SLACK,
            )  # fmt: skip
        plan = plan_ptr + row * 3
        tl.store(plan, peak)
        tl.store(plan + 1, inv_width)
        tl.store(plan + 2, floor)
        tl.store(bounds, kth)
        tl.store(bounds + 1, p_lo)
        tl.store(bounds + 2, p_hi)
        tl.store(bounds + 3, above_kth.to(tl.int32))
        tl.store(bounds + 5, kept.to(tl.int32))
        masses = masses_ptr + row * 4
        tl.store(masses, above_p_lo_mass)
        tl.store(masses + 1, above_kth_mass)
        tl.store(masses + 2, row_mass)
        tl.store(masses + 3, whole_kth_mass)
    else:
        tl.store(bounds + 5, 1)
    tl.store(bounds + 4, 0)  # boundary tokens gathered
    tl.store(bounds + 6, INT32_MAX)  # their least key
    tl.store(bounds + 7, INT32_MIN)  # their largest


@triton.jit
def _boundary(
    counts, masses, width, row_mass, top_k, top_p, with_top_k, with_top_p,
    BUCKETS: tl.constexpr, SLACK: tl.constexpr,
):  # fmt: skip
    """The buckets of the boundary, from each bucket's count and exact integer mass. A token
    is kept iff the mass above it is below top_p times the top-k mass (the row's without
    top-k): every token of a bucket is kept where the mass through the bucket is below it,
    none where the mass above the bucket reaches it. That mass is known but for the k-th
    token's bucket (its tokens from the k-th up), which bounds it: with top-p alone the
    boundary is one bucket."""
    bucket = tl.arange(0, BUCKETS)
    through = tl.cumsum(masses, 0)
    kth = tl.full((), BUCKETS, tl.int32)
    above_kth = tl.full((), 0, tl.int64)
    above_kth_mass = tl.full((), 0, tl.int64)
    least_mass, most_mass = row_mass, row_mass  # of the top-k set
    if with_top_k:
        kth = tl.sum((tl.cumsum(counts, 0) < top_k).to(tl.int32), 0)
        above_kth = tl.sum(tl.where(bucket < kth, counts, 0), 0)
        above_kth_mass = tl.sum(tl.where(bucket < kth, masses, 0), 0)
        # at least top_k - above_kth of the kth bucket's tokens, each above its lower edge
        kth_edge = tl.exp(-(kth + 1).to(tl.float32) * width) * (1.0 - SLACK) * FIXED
        kth_weight = tl.where(kth < BUCKETS - 1, kth_edge, 0.0).to(tl.int64)
        least_mass = above_kth_mass + (top_k - above_kth) * kth_weight
        most_mass = above_kth_mass + tl.sum(tl.where(bucket == kth, masses, 0), 0)
    p_lo = tl.full((), BUCKETS, tl.int32)
    p_hi = tl.full((), BUCKETS - 1, tl.int32)
    above_p_lo_mass = tl.full((), 0, tl.int64)
    if with_top_p:
        p_lo = tl.sum((through < _target(top_p, least_mass)).to(tl.int32), 0)
        p_hi = tl.minimum(tl.sum((through - masses < _target(top_p, most_mass)).to(tl.int32), 0) - 1, kth)
        above_p_lo_mass = tl.sum(tl.where(bucket < p_lo, masses, 0), 0)
    return kth, p_lo, p_hi, above_kth, above_p_lo_mass, above_kth_mass, most_mass


@triton.jit
def _target(top_p, top_k_mass):
    """The least integer mass at or above ``top_p * top_k_mass`` (in float64: exact for the
    integer masses, below 2**53), which the tokens above a kept one stay below. The plan and
    the search compute it alike."""
    return tl.ceil(top_p.to(tl.float64) * top_k_mass.to(tl.float64)).to(tl.int64)


@triton.jit
def _load_plan(plan_ptr, bounds_ptr, row):
    """peak, inv_width, floor, kth, p_lo, p_hi, above_kth, and whether the candidate settles the row."""
    plan, bounds = plan_ptr + row * 3, bounds_ptr + row * 8
    return (
        tl.load(plan), tl.load(plan + 1), tl.load(plan + 2),
        tl.load(bounds), tl.load(bounds + 1), tl.load(bounds + 2), tl.load(bounds + 3), tl.load(bounds + 5) != 0,
    )  # fmt: skip


@triton.jit
def _draw_kernel(
    logits_ptr, stride, vocab,
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr,
    plan_ptr, bounds_ptr, best_ptr, best_token_ptr, region_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, BUCKETS: tl.constexpr, REGION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per chunk of a filtered row that its candidate does not settle: the draw among the
    tokens above the boundary, the boundary's tokens appended to the row's region, their
    least and largest keys, and the draw among them that min-p keeps (the row's if they
    tie and are too many to gather)."""
    pdl_entry(PDL)
    row, chunk, chunks = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)
    temperature, top_k, top_p, min_p = _params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr)
    if _filtered(temperature, top_k, top_p, min_p, vocab):
        peak, inv_width, floor, kth, p_lo, p_hi, _, settled = _load_plan(plan_ptr, bounds_ptr, row)
        if not settled:
            inv_t = 1.0 / temperature
            noise_key = _noise_key(seed_ptr, position_ptr, row)
            best = tl.full((), float("-inf"), tl.float32)
            best_token = tl.full((), INT32_MAX, tl.int32)
            tied_best = tl.full((), float("-inf"), tl.float32)
            tied_token = tl.full((), INT32_MAX, tl.int32)
            least_key = tl.full((), INT32_MAX, tl.int32)
            largest_key = tl.full((), INT32_MIN, tl.int32)
            for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
                tokens = start + tl.arange(0, BLOCK)
                valid = tokens < vocab
                s = tl.load(logits_ptr + row * stride + tokens, mask=valid, other=float("-inf")).to(tl.float32)
                s = _above(s * inv_t, floor)
                bucket = _bucket(s, peak, inv_width, BUCKETS)
                finite = valid & (s > float("-inf"))
                min_p_kept = finite & (tl.exp(s - peak) >= min_p)
                kept = min_p_kept & (bucket < tl.minimum(p_lo, kth))
                boundary = finite & ((bucket == kth) | ((bucket >= p_lo) & (bucket <= p_hi)))
                if tl.max((kept | (boundary & min_p_kept)).to(tl.int32), 0) > 0:
                    scores = s + _gumbel(noise_key, tokens)
                    best, best_token = _take(best, best_token, tl.where(kept, scores, float("-inf")), tokens)
                    tied_scores = tl.where(boundary & min_p_kept, scores, float("-inf"))
                    tied_best, tied_token = _take(tied_best, tied_token, tied_scores, tokens)
                found = tl.sum(boundary.to(tl.int32), 0)
                if found > 0:
                    keys = _order_key(s)
                    least_key = tl.minimum(least_key, tl.min(tl.where(boundary, keys, INT32_MAX), 0))
                    largest_key = tl.maximum(largest_key, tl.max(tl.where(boundary, keys, INT32_MIN), 0))
                    first = tl.atomic_add(bounds_ptr + row * 8 + 4, found)
                    slots = first + tl.cumsum(boundary.to(tl.int32), 0) - 1
                    tl.store(region_ptr + row * REGION + slots, tokens, mask=boundary & (slots < REGION))
            tl.store(best_ptr + row * chunks + chunk, best)
            tl.store(best_token_ptr + row * chunks + chunk, best_token)
            tied = tl.num_programs(0) * chunks + row * chunks + chunk
            tl.store(best_ptr + tied, tied_best)
            tl.store(best_token_ptr + tied, tied_token)
            if largest_key >= least_key:
                tl.atomic_min(bounds_ptr + row * 8 + 6, least_key, sem="relaxed")
                tl.atomic_max(bounds_ptr + row * 8 + 7, largest_key, sem="relaxed")


@triton.jit
def _tokens(ids_ptr, start, count, GATHERED: tl.constexpr, SEARCH_BLOCK: tl.constexpr):
    """Tokens ``start ..`` of the boundary (``GATHERED``) or of the whole row."""
    index = start + tl.arange(0, SEARCH_BLOCK)
    valid = index < count
    if GATHERED:
        tokens = tl.load(ids_ptr + index, mask=valid, other=0)
    else:
        tokens = index
    return tokens, valid


@triton.jit
def _scores(row_ptr, tokens, valid, inv_t, peak, inv_width, floor, BUCKETS: tl.constexpr):
    """s (-inf at or below the floor), its bucket, its integer weight and its key, per token."""
    s = _above(tl.load(row_ptr + tokens, mask=valid, other=float("-inf")).to(tl.float32) * inv_t, floor)
    return s, _bucket(s, peak, inv_width, BUCKETS), _fixed_weight(s, peak), _order_key(s)


@triton.jit
def _search(
    row_ptr, ids_ptr, count, inv_t, peak, inv_width, floor, lo_bucket, hi_bucket, base, target,
    GATHERED: tl.constexpr, MASS: tl.constexpr,
    BUCKETS: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
):  # fmt: skip
    """The largest key ``v`` of the finite tokens in buckets ``lo_bucket ..= hi_bucket`` with
    ``base`` + their count (or integer mass, ``MASS``) at or above ``v`` reaching ``target``;
    their least key if none does; INT32_MIN if there are none."""
    lo = tl.full((), INT32_MAX, tl.int32)
    hi = tl.full((), INT32_MIN, tl.int32)
    members = tl.full((), 0, tl.int64)
    for start in range(0, count, SEARCH_BLOCK):
        tokens, valid = _tokens(ids_ptr, start, count, GATHERED, SEARCH_BLOCK)
        s, bucket, _, keys = _scores(row_ptr, tokens, valid, inv_t, peak, inv_width, floor, BUCKETS)
        member = valid & (s > float("-inf")) & (bucket >= lo_bucket) & (bucket <= hi_bucket)
        lo = tl.minimum(lo, tl.min(tl.where(member, keys, INT32_MAX), 0))
        hi = tl.maximum(hi, tl.max(tl.where(member, keys, INT32_MIN), 0))
        members += tl.sum(member.to(tl.int64), 0)
    none = lo > hi
    lo, hi = lo.to(tl.int64), hi.to(tl.int64) + 1  # base + F(>= lo) reaches target, or lo is the least key
    at_lo, at_hi = members, tl.full((), 0, tl.int64)  # members at or above lo, hi
    steps = tl.arange(1, PIVOTS + 1).to(tl.int64)
    # until one key is left between them (or one member: lo then keeps the same tokens as its key)
    while (hi - lo > 1) & (at_lo - at_hi > 1):
        pivots = lo + ((hi - lo) * steps) // (PIVOTS + 1)
        totals = tl.zeros((PIVOTS,), tl.int64)
        above_count = tl.zeros((PIVOTS,), tl.int64)
        for start in range(0, count, SEARCH_BLOCK):
            tokens, valid = _tokens(ids_ptr, start, count, GATHERED, SEARCH_BLOCK)
            s, bucket, weights, keys = _scores(row_ptr, tokens, valid, inv_t, peak, inv_width, floor, BUCKETS)
            member = valid & (s > float("-inf")) & (bucket >= lo_bucket) & (bucket <= hi_bucket)
            above = member[:, None] & (keys.to(tl.int64)[:, None] >= pivots[None, :])
            above_count += tl.sum(above.to(tl.int64), 0)
            if MASS:
                totals += tl.sum(tl.where(above, weights[:, None], 0), 0)
        if MASS:
            reached = base + totals >= target
        else:
            reached = base + above_count >= target
        # the highest pivot reached has the fewest members above of those reached; the lowest not, the most
        new_lo, at_lo = tl.max(tl.where(reached, pivots, lo), 0), tl.min(tl.where(reached, above_count, at_lo), 0)
        hi, at_hi = tl.min(tl.where(reached, hi, pivots), 0), tl.max(tl.where(reached, at_hi, above_count), 0)
        lo = new_lo
    return tl.where(none, INT32_MIN, lo.to(tl.int32))


@triton.jit
def _settle_kernel(
    logits_ptr, stride, vocab,
    temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, position_ptr,
    plan_ptr, bounds_ptr, masses_ptr, best_ptr, best_token_ptr, region_ptr, out_ptr, chunks,
    CHUNKS: tl.constexpr, BUCKETS: tl.constexpr, REGION: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    PIVOTS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_entry(PDL)
    row = tl.program_id(0).to(tl.int64)
    temperature, top_k, top_p, min_p = _params(row, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr)
    with_top_k, with_top_p = _with_top_k(temperature, top_k, vocab), _with_top_p(temperature, top_p)
    rows, chunk = tl.num_programs(0), tl.arange(0, CHUNKS)
    part = row * chunks + chunk
    settled = tl.load(bounds_ptr + row * 8 + 5) != 0
    # the stats pass drew the unfiltered rows and the candidates; the draw pass, the other
    # filtered rows' tokens above the boundary
    drawn = (~settled).to(tl.int64) * rows * chunks + part
    part_best = tl.load(best_ptr + drawn, mask=chunk < chunks, other=float("-inf"))
    best = tl.max(part_best, 0)
    best_token = tl.min(tl.where(part_best == best, tl.load(best_token_ptr + drawn, mask=chunk < chunks), INT32_MAX), 0)
    if not settled:
        peak, inv_width, floor, kth, p_lo, p_hi, above_kth, _ = _load_plan(plan_ptr, bounds_ptr, row)
        masses = masses_ptr + row * 4
        above_p_lo_mass, above_kth_mass, row_mass = tl.load(masses), tl.load(masses + 1), tl.load(masses + 2)
        whole_kth_mass = tl.load(masses + 3)
        least_key, largest_key = tl.load(bounds_ptr + row * 8 + 6), tl.load(bounds_ptr + row * 8 + 7)
        inv_t = 1.0 / temperature
        row_ptr = logits_ptr + row * stride
        noise_key = _noise_key(seed_ptr, position_ptr, row)
        gathered = tl.load(bounds_ptr + row * 8 + 4)
        if gathered <= REGION:
            cut = _settle(
                row_ptr, region_ptr + row * REGION, gathered, inv_t, peak, inv_width, floor, kth, p_lo, p_hi,
                above_kth, above_p_lo_mass, above_kth_mass, row_mass, top_k, top_p, with_top_k, with_top_p,
                True, BUCKETS, SEARCH_BLOCK, PIVOTS,
            )  # fmt: skip
            best, best_token = _draw(
                row_ptr, region_ptr + row * REGION, gathered, inv_t, peak, inv_width, floor, cut, min_p, noise_key,
                best, best_token, True, BUCKETS, SEARCH_BLOCK,
            )  # fmt: skip
        elif least_key == largest_key:  # more tokens than the region holds, all tied: kept alike
            if _tied_kept(
                least_key, peak, inv_width, p_lo, p_hi, above_p_lo_mass, whole_kth_mass, top_p, with_top_p, BUCKETS
            ):
                tied = 2 * rows * chunks + part
                tied_best = tl.load(best_ptr + tied, mask=chunk < chunks, other=float("-inf"))
                tied_token = tl.load(best_token_ptr + tied, mask=chunk < chunks, other=INT32_MAX)
                best, best_token = _take(best, best_token, tied_best, tied_token)
        else:  # more tokens than the region holds, of several keys: found in the whole row
            cut = _settle(
                row_ptr, region_ptr, vocab, inv_t, peak, inv_width, floor, kth, p_lo, p_hi,
                above_kth, above_p_lo_mass, above_kth_mass, row_mass, top_k, top_p, with_top_k, with_top_p,
                False, BUCKETS, SEARCH_BLOCK, PIVOTS,
            )  # fmt: skip
            best, best_token = _draw(
                row_ptr, region_ptr, vocab, inv_t, peak, inv_width, floor, cut, min_p, noise_key,
                best, best_token, False, BUCKETS, SEARCH_BLOCK,
            )  # fmt: skip
    tl.store(out_ptr + row, best_token.to(tl.int64))


@triton.jit
def _tied_kept(
    key, peak, inv_width, p_lo, p_hi, above_p_lo_mass, whole_kth_mass, top_p, with_top_p, BUCKETS: tl.constexpr
):
    """Whether top-k and top-p keep a boundary whose tokens all have ``key``. They lie in one
    bucket, the k-th token's if there is one: top-k keeps them (theirs is the k-th key) and
    its mass is all of it and above. Top-p keeps them above its boundary, drops them below
    and, within, keeps them iff the mass above them is below its target: the mass above
    p_lo (the boundary's other buckets are empty)."""
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    bucket = _bucket(bits.to(tl.float32, bitcast=True), peak, inv_width, BUCKETS)
    within = (bucket >= p_lo) & (bucket <= p_hi)
    return ~with_top_p | (bucket < p_lo) | (within & (above_p_lo_mass < _target(top_p, whole_kth_mass)))


@triton.jit
def _settle(
    row_ptr, ids_ptr, count, inv_t, peak, inv_width, floor, kth, p_lo, p_hi,
    above_kth, above_p_lo_mass, above_kth_mass, row_mass, top_k, top_p, with_top_k, with_top_p,
    GATHERED: tl.constexpr, BUCKETS: tl.constexpr, SEARCH_BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
):  # fmt: skip
    """The least key top-k and top-p keep, from the boundary tokens: the k-th largest key
    among the tokens of bucket ``kth`` (``above_kth`` lie above it), then the top-p cut among
    ``[p_lo, p_hi]``'s against top_p times the top-k mass (the row's without top-k); the
    integer masses above p_lo and above kth are the plan's."""
    cut = tl.full((), INT32_MIN, tl.int32)
    top_k_mass = row_mass
    if with_top_k:
        cut = _search(
            row_ptr, ids_ptr, count, inv_t, peak, inv_width, floor, kth, kth, above_kth, top_k,
            GATHERED, False, BUCKETS, SEARCH_BLOCK, PIVOTS,
        )  # fmt: skip
        mass = tl.zeros((SEARCH_BLOCK,), tl.int64)
        for start in range(0, count, SEARCH_BLOCK):
            tokens, valid = _tokens(ids_ptr, start, count, GATHERED, SEARCH_BLOCK)
            _, bucket, weights, keys = _scores(row_ptr, tokens, valid, inv_t, peak, inv_width, floor, BUCKETS)
            mass += tl.where(valid & (bucket == kth) & (keys >= cut), weights, 0)
        top_k_mass = above_kth_mass + tl.sum(mass, 0)
    if with_top_p & (p_lo <= p_hi):
        cut = tl.maximum(
            cut,
            _search(
                row_ptr, ids_ptr, count, inv_t, peak, inv_width, floor, p_lo, p_hi,
                above_p_lo_mass, _target(top_p, top_k_mass), GATHERED, True, BUCKETS, SEARCH_BLOCK, PIVOTS,
            ),
        )  # fmt: skip
    return cut


@triton.jit
def _draw(
    row_ptr, ids_ptr, count, inv_t, peak, inv_width, floor, cut, min_p, noise_key, best, best_token,
    GATHERED: tl.constexpr, BUCKETS: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
):  # fmt: skip
    """The running best (score, token) over the tokens at or above ``cut`` that min-p keeps."""
    for start in range(0, count, SEARCH_BLOCK):
        tokens, valid = _tokens(ids_ptr, start, count, GATHERED, SEARCH_BLOCK)
        s, _, _, keys = _scores(row_ptr, tokens, valid, inv_t, peak, inv_width, floor, BUCKETS)
        kept = valid & (keys >= cut) & (tl.exp(s - peak) >= min_p) & (s > float("-inf"))
        scores = tl.where(kept, s + _gumbel(noise_key, tokens), float("-inf"))
        best, best_token = _take(best, best_token, scores, tokens)
    return best, best_token


def sample(logits: Tensor, params: SamplingBatch, chunk: int = CHUNK, region: int = REGION) -> Tensor:
    """Token ids [rows] drawn from ``logits`` [rows, vocab] (see :meth:`xinfer.ops.Ops.sample`);
    ``chunk`` and ``region`` are small in tests, so that small rows exercise every path."""
    return _sample(logits, params, chunk, region)[0]


CANDIDATE, BOUNDARY, TIED, WHOLE_ROW = 0, 1, 2, 3


def sample_paths(
    logits: Tensor, params: SamplingBatch, chunk: int = CHUNK, region: int = REGION
) -> tuple[Tensor, Tensor]:
    """:func:`sample`'s tokens, and the path that settled each row (for tests and benchmarks):
    CANDIDATE (its candidate was kept, or it has no filter), BOUNDARY (the gathered boundary
    tokens), TIED (more than ``region`` boundary tokens, all tied) or WHOLE_ROW (more than
    ``region``, not all tied: a search over the whole row)."""
    tokens, bounds = _sample(logits, params, chunk, region)
    settled, gathered, tied = bounds[:, 5] != 0, bounds[:, 4], bounds[:, 6] == bounds[:, 7]
    crowded = torch.where(tied, TIED, WHOLE_ROW)
    return tokens, torch.where(settled, CANDIDATE, torch.where(gathered <= region, BOUNDARY, crowded))


def _sample(logits: Tensor, params: SamplingBatch, chunk: int, region: int) -> tuple[Tensor, Tensor]:
    """The tokens, and each row's bounds (the plan's, and the count of its gathered boundary)."""
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    bounds = torch.empty(rows, 8, dtype=torch.int32, device=logits.device)
    if rows == 0:
        return tokens, bounds
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, chunk)
    device = logits.device
    stats = torch.empty(rows, chunks, 3, dtype=torch.float32, device=device)
    checks = torch.empty(rows, chunks, 3 + PROBES, dtype=torch.float32, device=device)
    histogram = torch.zeros(rows, 2, BUCKETS, dtype=torch.int64, device=device)  # counts, integer masses
    chunk_mass = torch.empty(rows, chunks, dtype=torch.int64, device=device)
    plan = torch.empty(rows, 3, dtype=torch.float32, device=device)
    masses = torch.empty(rows, 4, dtype=torch.int64, device=device)
    best = torch.empty(3, rows, chunks, dtype=torch.float32, device=device)
    best_token = torch.empty(3, rows, chunks, dtype=torch.int32, device=device)
    gathered = torch.empty(rows, region, dtype=torch.int32, device=device)
    filters = (params.temperature, params.top_k, params.top_p, params.min_p)
    noise = (params.seed, params.position)
    row = (logits, logits.stride(0), vocab)
    candidates = (stats, best[0], best_token[0], checks)
    block = min(BLOCK, chunk)
    # unfused arithmetic: every launch computes the same s and bucket of a token as the others (and s as torch)
    options = {"num_warps": 4, "enable_fp_fusion": False, **launch.pdl(device)}
    sizes = {"CHUNKS": triton.next_power_of_2(chunks), "PROBES": PROBES}
    # the stats pass, which draws every token, holds its whole chunk at once: its five reductions once a program
    _stats_kernel[(rows, chunks)](
        *row, *filters, *noise, stats, best[0], best_token[0], CHUNK=chunk, BLOCK=chunk, **{**options, "num_warps": 8}
    )
    _check_kernel[(rows, chunks)](*row, *filters[:3], *candidates, chunks, CHUNK=chunk, BLOCK=block, **sizes, **options)
    _histogram_kernel[(rows, chunks)](
        *row, *filters, *candidates, histogram, chunk_mass, chunks,
        CHUNK=chunk, BLOCK=block, BUCKETS=BUCKETS, SPREAD=SPREAD, **sizes, **{**options, "num_warps": 8},
    )  # fmt: skip
    _plan_kernel[(rows,)](
        *row, *filters, *candidates, histogram, chunk_mass, plan, bounds, masses, chunks,
        BUCKETS=BUCKETS, SPREAD=SPREAD, SLACK=SLACK, **sizes, **{**options, "num_warps": 16},
    )  # fmt: skip
    _draw_kernel[(rows, chunks)](
        *row, *filters, *noise, plan, bounds, best[1:], best_token[1:], gathered,
        CHUNK=chunk, BLOCK=block, BUCKETS=BUCKETS, REGION=region, **options,
    )  # fmt: skip
    _settle_kernel[(rows,)](
        *row, *filters, *noise, plan, bounds, masses, best, best_token, gathered, tokens, chunks,
        CHUNKS=sizes["CHUNKS"], BUCKETS=BUCKETS, REGION=region, SEARCH_BLOCK=SEARCH_BLOCK, PIVOTS=PIVOTS, **options,
    )  # fmt: skip
    return tokens, bounds
