"""Paged attention over the block tables of :class:`xinfer.ops.AttentionMetadata`.

Two kernels share one inner loop (:func:`_attend_keys`, online softmax in fp32, base 2):

- ``_prefill_kernel`` for the sequences of a step with more than one query (prefill,
  chunked prefill, prefix-cached prefill). One program per (query tile of the flat
  batch, KV head); each finds its sequence in ``cu_seqlens_q``, so the grid depends
  only on the token and sequence counts and a step with prompt tokens can be a CUDA
  graph replay too. The rows of a tile are (query, head of the KV head's group)
  pairs, so a K/V tile loaded once serves the whole GQA group.
- ``_decode_kernel`` + ``_decode_reduce_kernel`` for the sequences with one query,
  in decode steps and in steps that mix decodes with prompt chunks (in a prefill
  tile one query would fill a group's rows of a 128-row tile and leave the rest
  idle). Flash-decoding: each sequence's context is split across ``num_splits``
  programs per KV head, which write partial (acc, max, sum); the reduce merges them,
  or, where a context filled few splits, the last of a KV head's programs to finish does
  (a counter per (sequence, KV head)); a grid of few splits launches no reduce. The split
  count is the grid's, from shapes (the graph's longest context); a shorter context fills
  only the splits its keys need (at least a minimum split each) and the grid's other
  programs exit at once, so the merge reads only the parts that ran.
  With a recent window the keys that may be exact (the first block, the last
  ``recent``) are read by a launch of its own, one program per (sequence, KV head),
  on a second stream beside the splits, which share the rest.
  KV heads are the grid's fastest axis, so programs start in row order, every head of
  a sequence together: the engine's rows come longest context first.
  The grid depends only on tensor shapes and the split lengths are computed from
  ``seq_lens`` inside the kernels, so a captured CUDA graph stays valid as contexts
  grow.

K/V addresses are computed per token through the block table, so the cache block size
(any power of two) is independent of the tile size. Each side of the cache has a code
(``kv_codes.py``): plain caches are loaded as they are; quantized ones (fp8, packed 4-
and 3-bit, with per-(token, head) scales) are decoded in registers right after each
tile is loaded, never into a copy of the cache. Where a side packs 4- or 3-bit codes
the kernels hold rows as two halves of the head dimension, which is how those codes
are laid out (``SPLIT``; see :func:`~xinfer_cuda.kernels.kv_codes.half_columns`), and
so does fp8 decode at batches that leave multiprocessors idle (:func:`attend_sides`).
With a recent window, keys near each query and in the first block are read from
exact shadow blocks instead (``EXACT``; :class:`ExactWindow`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import LOG2E, MAX_SPLITS, decode_num_splits
from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata
from xinfer_cuda.kernels import arrivals, launch
from xinfer_cuda.kernels.arrivals import last_to_arrive
from xinfer_cuda.kernels.basis import signed_basis
from xinfer_cuda.kernels.kv_codes import (
    CODE_PLAIN,
    CODE_UNIFORM,
    LLOYD,
    PLAIN,
    Side,
    decode_method,
    half_columns,
    load_scale,
    load_stored,
    side,
)
from xinfer_cuda.kernels.kv_quant_write import rotate_queries
from xinfer_cuda.kernels.launch import pdl_entry
from xinfer_cuda.kernels.shared import NEG_BIG, prefetch_l2, tile_owner
from xinfer_cuda.kernels.three_bit_keys import three_bit_scores

MASK_NONE: tl.constexpr = tl.constexpr(0)  # every key of the range is visible to every row
MASK_BOUNDS: tl.constexpr = tl.constexpr(1)  # keys past the end of the range are hidden
MASK_CAUSAL: tl.constexpr = tl.constexpr(2)  # causal (and window) mask per row


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


# Rows of the rotation's signs per dot in the output epilogue: a [32, head_dim] slice
# of them on chip at a time, even at head_dim 256 (all below 32).
ROTATION_CHUNK = 32


@triton.jit
def _load_queries(q_ptr, q_off, row_ok, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, HALF_D: tl.constexpr):
    """Query rows at element offsets ``q_off`` as two halves [M, HALF_D] (:func:`half_columns`)."""
    cols, lo_ok, hi_ok = half_columns(HEAD_DIM, SPLIT, HALF_D)
    at = q_ptr + q_off[:, None] + cols[None, :]
    q_lo = tl.load(at, mask=row_ok[:, None] & lo_ok[None, :], other=0.0)
    q_hi = q_lo  # unused when rows are whole
    if SPLIT < HEAD_DIM:  # a second half
        q_hi = tl.load(at + SPLIT, mask=row_ok[:, None] & hi_ok[None, :], other=0.0)
    return q_lo, q_hi


@triton.jit
def _store_rows(
    out_ptr, o_off, row_ok, x_lo, x_hi, basis_ptr,
    HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, HALF_D: tl.constexpr, ROTATE: tl.constexpr,
    CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Store rows given as halves (:func:`half_columns`) at element offsets ``o_off``;
    for rotated values back in the model's basis first (``x @ signsᵀ / sqrt(D)``, a
    slice of output columns at a time)."""
    cols, lo_ok, hi_ok = half_columns(HEAD_DIM, SPLIT, HALF_D)
    if ROTATE:
        for c in tl.range(0, HEAD_DIM, CHUNK, num_stages=1):
            outs = c + tl.arange(0, CHUNK)
            signs = basis_ptr + outs[:, None] * HEAD_DIM + cols[None, :]
            lo = tl.load(signs, mask=lo_ok[None, :], other=0).to(tl.float32)
            y = tl.dot(x_lo, tl.trans(lo), input_precision=PRECISION)
            if SPLIT < HEAD_DIM:  # a second half
                hi = tl.load(signs + SPLIT, mask=hi_ok[None, :], other=0).to(tl.float32)
                y = tl.dot(x_hi, tl.trans(hi), y, input_precision=PRECISION)
            y *= 1.0 / HEAD_DIM**0.5
            tl.store(out_ptr + o_off[:, None] + outs[None, :], y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        at = out_ptr + o_off[:, None] + cols[None, :]
        tl.store(at, x_lo.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & lo_ok[None, :])
        if SPLIT < HEAD_DIM:  # a second half
            tl.store(at + SPLIT, x_hi.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & hi_ok[None, :])


@triton.jit
def _code_scores(q_k_lo, q_k_hi, q_sum, k_head_ptr, k_levels_ptr, k_row, k_scale_head_ptr, block, slot,
                 stride_s_block, stride_s_slot, rows_ok, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 SPLIT: tl.constexpr, HALF_D: tl.constexpr, PRECISION: tl.constexpr, CODE_DTYPE: tl.constexpr,
                 DECODE: tl.constexpr, K_CODE: tl.constexpr, K_BITS: tl.constexpr, K_OFFSET: tl.constexpr,
                 K_STEP: tl.constexpr):  # fmt: skip
    """Scores against the stored keys of ``k_row``, then each key's (offset, scale)
    applied to its column: q . ((k - offset) * step * scale) = (q . k - offset * sum(q)) * step * scale.
    Uniform 3-bit keys at D >= 128 are read in eighths of the head dimension
    (``three_bit_keys``); other keys as two halves (or whole rows)."""
    EIGHTHS: tl.constexpr = K_CODE == CODE_UNIFORM and K_BITS == 3 and HEAD_DIM >= 128
    if EIGHTHS:
        s = three_bit_scores(q_k_lo, q_k_hi, k_head_ptr, k_row, rows_ok, HEAD_DIM, CODE_DTYPE, DECODE, PRECISION)
    else:
        k_lo, k_hi = load_stored(k_head_ptr, k_levels_ptr, k_row, rows_ok, BLOCK_N, HEAD_DIM, SPLIT, HALF_D,
                                 K_CODE, K_BITS, CODE_DTYPE, DECODE)  # fmt: skip
        s = tl.dot(q_k_lo, tl.trans(k_lo), input_precision=PRECISION)
        if SPLIT < HEAD_DIM:  # a second half
            s = tl.dot(q_k_hi, tl.trans(k_hi), s, input_precision=PRECISION)
    if K_CODE != CODE_PLAIN:
        if K_OFFSET != 0.0:
            s -= K_OFFSET * q_sum[:, None]
        k_scale = load_scale(k_scale_head_ptr, block, slot, stride_s_block, stride_s_slot, rows_ok)
        s *= (k_scale * K_STEP)[None, :]
    return s


@triton.jit
def _add_code_values(acc_lo, acc_hi, p, v_lo, v_hi, v_scale_head_ptr, block, slot, stride_s_block, stride_s_slot,
                     rows_ok, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                     V_CODE: tl.constexpr, V_OFFSET: tl.constexpr, V_STEP: tl.constexpr):  # fmt: skip
    """acc + p @ stored values; like the keys', each value row's scale goes into p:
    p @ ((v - offset) * step * scale) = (p * step * scale) @ v - offset * sum(p * step * scale)."""
    if V_CODE == CODE_PLAIN:
        pv = p.to(v_lo.dtype)
    else:
        v_scale = load_scale(v_scale_head_ptr, block, slot, stride_s_block, stride_s_slot, rows_ok)
        pv = (p * (v_scale * V_STEP)[None, :]).to(v_lo.dtype)
    acc_lo = tl.dot(pv, v_lo, acc_lo, input_precision=PRECISION)
    if SPLIT < HEAD_DIM:  # a second half
        acc_hi = tl.dot(pv, v_hi, acc_hi, input_precision=PRECISION)
    if V_OFFSET != 0.0:
        pv_sum = tl.sum(pv.to(tl.float32), 1)[:, None]
        acc_lo -= V_OFFSET * pv_sum
        if SPLIT < HEAD_DIM:  # a second half
            acc_hi -= V_OFFSET * pv_sum
    return acc_lo, acc_hi


@triton.jit
def _attend_tile(
    acc_lo,
    acc_hi,
    l_i,
    m_i,
    q_k_lo,
    q_k_hi,
    q_sum,
    q_pos,
    q_lim,
    tile_start,
    end,
    k_head_ptr,
    v_head_ptr,
    k_scale_head_ptr,
    v_scale_head_ptr,
    k_levels_ptr,
    v_levels_ptr,
    block_table_ptr,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    stride_s_block,
    stride_s_slot,
    score_scale,
    cap_scale,
    window,
    ek_head_ptr,
    ev_head_ptr,
    shadow_table_ptr,
    stride_e_block,
    stride_e_slot,
    recent,
    MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF_D: tl.constexpr,
    PRECISION: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    DECODE: tl.constexpr,
    K_CODE: tl.constexpr,
    K_BITS: tl.constexpr,
    K_OFFSET: tl.constexpr,
    K_STEP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_OFFSET: tl.constexpr,
    V_STEP: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Fold the tile of keys at ``tile_start`` (those before ``end``) into the running
    (acc, l_i, m_i). ``q_k_*`` are the queries in the dtype key tiles are built in and
    ``q_sum`` their sum (used where key codes have an offset); :func:`_attend_keys`
    describes the rest."""
    k_pos = tile_start + tl.arange(0, BLOCK_N)
    in_range = k_pos < end
    block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    slot = k_pos % BLOCK_SIZE
    k_row = block * stride_k_block + slot * stride_k_slot
    v_row = block * stride_v_block + slot * stride_v_slot
    if EXACT:
        shadow = tl.load(shadow_table_ptr + k_pos // BLOCK_SIZE, mask=in_range, other=-1)
        e_ok = shadow >= 0  # (false past the range)
        e_row = tl.maximum(shadow, 0).to(tl.int64) * stride_e_block + slot * stride_e_slot  # K and V alike
        near = (q_pos[:, None] - k_pos[None, :] < recent) | (k_pos[None, :] < BLOCK_SIZE)
        exact = near & e_ok[None, :]
        # The codes only where a row reads a key of the tile from them: in decode, where
        # a recent block has no shadow (a prefix-cache hit's), so mostly never.
        reads_codes = tl.sum((in_range[None, :] & ~exact).to(tl.int32)) > 0
        s = tl.zeros([q_k_lo.shape[0], BLOCK_N], tl.float32)
        if reads_codes:
            s = _code_scores(q_k_lo, q_k_hi, q_sum, k_head_ptr, k_levels_ptr, k_row, k_scale_head_ptr, block, slot,
                             stride_s_block, stride_s_slot, in_range, BLOCK_N, HEAD_DIM, SPLIT, HALF_D, PRECISION,
                             CODE_DTYPE, DECODE, K_CODE, K_BITS, K_OFFSET, K_STEP)  # fmt: skip
        ek_lo, ek_hi = load_stored(ek_head_ptr, ek_head_ptr, e_row, e_ok, BLOCK_N, HEAD_DIM, SPLIT, HALF_D,
                                   CODE_PLAIN, 16, CODE_DTYPE, DECODE)  # fmt: skip
        s_exact = tl.dot(q_k_lo, tl.trans(ek_lo.to(CODE_DTYPE)), input_precision=PRECISION)
        if SPLIT < HEAD_DIM:  # a second half
            s_exact = tl.dot(q_k_hi, tl.trans(ek_hi.to(CODE_DTYPE)), s_exact, input_precision=PRECISION)
        s = tl.where(exact, s_exact, s)
    else:
        v_lo, v_hi = load_stored(v_head_ptr, v_levels_ptr, v_row, in_range, BLOCK_N, HEAD_DIM, SPLIT, HALF_D,
                                 V_CODE, V_BITS, CODE_DTYPE, DECODE)  # fmt: skip
        s = _code_scores(q_k_lo, q_k_hi, q_sum, k_head_ptr, k_levels_ptr, k_row, k_scale_head_ptr, block, slot,
                         stride_s_block, stride_s_slot, in_range, BLOCK_N, HEAD_DIM, SPLIT, HALF_D, PRECISION,
                         CODE_DTYPE, DECODE, K_CODE, K_BITS, K_OFFSET, K_STEP)  # fmt: skip
    if HAS_SOFTCAP:
        s = cap_scale * _tanh(s * score_scale)
    else:
        s = s * score_scale
    if MASK == MASK_BOUNDS:
        s = tl.where(in_range[None, :], s, float("-inf"))
    if MASK == MASK_CAUSAL:
        visible = in_range[None, :] & (k_pos[None, :] <= q_lim[:, None])
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc_lo, acc_hi = acc_lo * alpha[:, None], acc_hi * alpha[:, None]
    if EXACT:  # the exact keys' weights go to the shadow values, the others' to the codes
        ev_lo, ev_hi = load_stored(ev_head_ptr, ev_head_ptr, e_row, e_ok, BLOCK_N, HEAD_DIM, SPLIT, HALF_D,
                                   CODE_PLAIN, 16, CODE_DTYPE, DECODE)  # fmt: skip
        pe = tl.where(exact, p, 0.0).to(CODE_DTYPE)
        acc_lo = tl.dot(pe, ev_lo.to(CODE_DTYPE), acc_lo, input_precision=PRECISION)
        if SPLIT < HEAD_DIM:  # a second half
            acc_hi = tl.dot(pe, ev_hi.to(CODE_DTYPE), acc_hi, input_precision=PRECISION)
        if reads_codes:
            v_lo, v_hi = load_stored(v_head_ptr, v_levels_ptr, v_row, in_range, BLOCK_N, HEAD_DIM, SPLIT, HALF_D,
                                     V_CODE, V_BITS, CODE_DTYPE, DECODE)  # fmt: skip
            acc_lo, acc_hi = _add_code_values(acc_lo, acc_hi, tl.where(exact, 0.0, p), v_lo, v_hi, v_scale_head_ptr,
                                              block, slot, stride_s_block, stride_s_slot, in_range,
                                              HEAD_DIM, SPLIT, PRECISION, V_CODE, V_OFFSET, V_STEP)  # fmt: skip
    else:
        acc_lo, acc_hi = _add_code_values(acc_lo, acc_hi, p, v_lo, v_hi, v_scale_head_ptr,
                                          block, slot, stride_s_block, stride_s_slot, in_range,
                                          HEAD_DIM, SPLIT, PRECISION, V_CODE, V_OFFSET, V_STEP)  # fmt: skip
    return acc_lo, acc_hi, l_i, m_new


@triton.jit
def _exact_spans(start, end, near_from, BLOCK_SIZE: tl.constexpr):
    """Where keys [start, end) split into the spans :func:`_attend_keys` reads with a
    recent window: exact tiles over the first block up to ``head_end``, plain tiles up
    to ``far_end`` (the first position any row reads by recency, ``near_from``), exact
    tiles over the rest."""
    head_end = tl.minimum(tl.maximum(start, BLOCK_SIZE), end)
    return head_end, tl.maximum(tl.minimum(near_from, end), head_end)


@triton.jit
def _attend_keys(
    acc_lo,
    acc_hi,
    l_i,
    m_i,
    q_lo,
    q_hi,
    q_pos,
    q_lim,
    start,
    end,
    k_head_ptr,
    v_head_ptr,
    k_scale_head_ptr,
    v_scale_head_ptr,
    k_levels_ptr,
    v_levels_ptr,
    block_table_ptr,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    stride_s_block,
    stride_s_slot,
    score_scale,
    cap_scale,
    window,
    ek_head_ptr,
    ev_head_ptr,
    shadow_table_ptr,
    stride_e_block,
    stride_e_slot,
    recent,
    near_from,
    MASK: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF_D: tl.constexpr,
    PRECISION: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    DECODE: tl.constexpr,
    K_CODE: tl.constexpr,
    K_BITS: tl.constexpr,
    K_OFFSET: tl.constexpr,
    K_STEP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_OFFSET: tl.constexpr,
    V_STEP: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Fold the keys at positions [start, end) into the running (acc, l_i, m_i).

    ``k_head_ptr`` and ``v_head_ptr`` point at the KV head's first element in the caches
    (and the scale pointers at its first scale); quantized tiles are decoded in registers.
    Rows, tiles and accumulators are halves of the head dimension where the cache has
    4- or 3-bit codes (:func:`half_columns`): a 4-bit byte holds a dimension of each
    half, so its two nibbles feed two half-width dots with no shuffle between them.

    With ``EXACT`` (a recent window over a quantized cache), a key the row reads exact
    (its block has a shadow in ``shadow_table_ptr`` and it is within ``recent`` of the
    row's position or in the first block) is scored and weighted from the shadows
    ``ek_head_ptr``/``ev_head_ptr`` (model dtype, the stored basis) instead. Only the
    first block and the keys from ``near_from`` (the first position any row reads exact
    by recency) on can be read so; they go through short tiles of their own (32 keys or
    fewer: where a tile reads codes, it reads shadows beside them, and beside a
    128-key quantized tile they spilled), and the keys between them through whole
    tiles that read no shadows and hide the keys past their span's end.
    """
    if K_CODE == CODE_PLAIN:
        q_k_lo, q_k_hi = q_lo, q_hi
    else:
        q_k_lo, q_k_hi = q_lo.to(CODE_DTYPE), q_hi.to(CODE_DTYPE)  # the dtype quantized tiles are built in
    q_sum = l_i  # unused unless key codes have an offset
    if K_OFFSET != 0.0:
        q_sum = tl.sum(q_k_lo.to(tl.float32), 1)
        if SPLIT < HEAD_DIM:  # a second half
            q_sum += tl.sum(q_k_hi.to(tl.float32), 1)
    # With EXACT, three spans: short tiles over the first block, whole tiles up to
    # near_from (they read no shadows; the last one cut short there), short tiles over the
    # rest; each span hides the keys past its own end. Without, one span: [start, end).
    EXACT_N: tl.constexpr = 32 if BLOCK_N >= 64 else 16
    OWN_END: tl.constexpr = MASK_BOUNDS if MASK == MASK_NONE else MASK
    head_end, far_end = start, end
    if EXACT:
        head_end, far_end = _exact_spans(start, end, near_from, BLOCK_SIZE)
    for span in tl.static_range(3):  # (a span's constants are expressions: constexprs cannot be reassigned)
        if EXACT or span == 1:
            lo = start if span == 0 else head_end if span == 1 else far_end
            hi = head_end if span == 0 else far_end if span == 1 else end
            for tile_start in range(lo, hi, EXACT_N if EXACT and span != 1 else BLOCK_N):
                acc_lo, acc_hi, l_i, m_i = _attend_tile(
                    acc_lo, acc_hi, l_i, m_i, q_k_lo, q_k_hi, q_sum, q_pos, q_lim, tile_start, hi,
                    k_head_ptr, v_head_ptr, k_scale_head_ptr, v_scale_head_ptr, k_levels_ptr, v_levels_ptr, block_table_ptr,
                    stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, stride_s_block, stride_s_slot,
                    score_scale, cap_scale, window, ek_head_ptr, ev_head_ptr, shadow_table_ptr, stride_e_block, stride_e_slot,
                    recent, MASK if not EXACT else OWN_END, HAS_WINDOW, HAS_SOFTCAP, EXACT_N if EXACT and span != 1 else BLOCK_N,
                    BLOCK_SIZE, HEAD_DIM, SPLIT, HALF_D, PRECISION, CODE_DTYPE, DECODE,
                    K_CODE, K_BITS, K_OFFSET, K_STEP, V_CODE, V_BITS, V_OFFSET, V_STEP, EXACT and span != 1,
                )  # fmt: skip
    return acc_lo, acc_hi, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_levels_ptr,
    v_levels_ptr,
    basis_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    key_limits_ptr,
    score_scale,
    cap_scale,
    window,
    ek_cache_ptr,
    ev_cache_ptr,
    shadow_tables_ptr,
    stride_e_block,
    stride_e_slot,
    stride_e_head,
    stride_st,
    recent,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    stride_bt,
    GROUP: tl.constexpr,
    Q_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_LIMITS: tl.constexpr,
    PRECISION: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    DECODE: tl.constexpr,
    K_CODE: tl.constexpr,
    K_BITS: tl.constexpr,
    K_OFFSET: tl.constexpr,
    K_STEP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_OFFSET: tl.constexpr,
    V_STEP: tl.constexpr,
    ROTATE_OUT: tl.constexpr,
    ROTATION_CHUNK: tl.constexpr,
    EXACT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    # Sequences in row order (the engine's rows come longest context first), and each
    # one's last query tiles first: under the causal mask they see the most keys. The
    # longest work starts first, which shortens the tail of the launch.
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tile_owner(cu_seqlens_q_ptr, num_seqs, tile, Q_PER_TILE)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    nth_tile = tile - q_start // Q_PER_TILE - seq
    first_q = (tl.cdiv(q_len, Q_PER_TILE) - 1 - nth_tile) * Q_PER_TILE
    if first_q < 0 or q_len == 1:  # one query: the decode kernel's
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # the step's queries are the last q_len positions

    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < Q_PER_TILE * GROUP) & (q_idx < q_len)
    q_pos = ctx_start + q_idx
    q_lim = q_pos  # the last key each row sees
    if HAS_LIMITS:  # the tokens of an image see its later ones too (AttentionMetadata.key_limits)
        q_lim = tl.load(key_limits_ptr + q_start + q_idx, mask=row_ok, other=0)
    q_off = (q_start + q_idx).to(tl.int64) * stride_q_tok + head * stride_q_head
    q_lo, q_hi = _load_queries(q_ptr, q_off, row_ok, HEAD_DIM, SPLIT, HALF_D)

    # Keys [full_lo, full_hi) are visible to every row of the tile and need no mask;
    # the ones before (window edge) and after (causal diagonal) do.
    first_pos = ctx_start + first_q
    last_pos = ctx_start + tl.minimum(first_q + Q_PER_TILE, q_len) - 1
    hi = last_pos + 1
    full_hi = first_pos + 1
    if HAS_LIMITS:  # (a limit is never below its row's position)
        hi = tl.max(tl.where(row_ok, q_lim, 0)) + 1
        full_hi = tl.min(tl.where(row_ok, q_lim, seq_len)) + 1
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, 0)
    else:
        lo = 0
        full_lo = 0
    full_end = full_lo + tl.maximum(full_hi - full_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF_D], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    k_scale_head = k_scale_ptr + kv_head * stride_s_head
    v_scale_head = v_scale_ptr + kv_head * stride_s_head
    ek_head = ek_cache_ptr + kv_head * stride_e_head
    ev_head = ev_cache_ptr + kv_head * stride_e_head
    shadow_table = shadow_tables_ptr + seq.to(tl.int64) * stride_st
    near_from = first_pos - recent + 1
    if HAS_WINDOW:
        acc_lo, acc_hi, l_i, m_i = _attend_keys(
            acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, q_pos, q_lim, lo, full_lo,
            k_head, v_head, k_scale_head, v_scale_head, k_levels_ptr, v_levels_ptr, block_table,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, stride_s_block, stride_s_slot,
            score_scale, cap_scale, window, ek_head, ev_head, shadow_table, stride_e_block, stride_e_slot, recent, near_from,
            MASK_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_SIZE, HEAD_DIM, SPLIT, HALF_D,
        PRECISION, CODE_DTYPE, DECODE,
            K_CODE, K_BITS, K_OFFSET, K_STEP, V_CODE, V_BITS, V_OFFSET, V_STEP, EXACT,
        )  # fmt: skip
    acc_lo, acc_hi, l_i, m_i = _attend_keys(
        acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, q_pos, q_lim, full_lo, full_end,
        k_head, v_head, k_scale_head, v_scale_head, k_levels_ptr, v_levels_ptr, block_table,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, stride_s_block, stride_s_slot,
        score_scale, cap_scale, window, ek_head, ev_head, shadow_table, stride_e_block, stride_e_slot, recent, near_from,
        MASK_NONE, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_SIZE, HEAD_DIM, SPLIT, HALF_D,
        PRECISION, CODE_DTYPE, DECODE,
        K_CODE, K_BITS, K_OFFSET, K_STEP, V_CODE, V_BITS, V_OFFSET, V_STEP, EXACT,
    )  # fmt: skip
    acc_lo, acc_hi, l_i, m_i = _attend_keys(
        acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, q_pos, q_lim, full_end, hi,
        k_head, v_head, k_scale_head, v_scale_head, k_levels_ptr, v_levels_ptr, block_table,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, stride_s_block, stride_s_slot,
        score_scale, cap_scale, window, ek_head, ev_head, shadow_table, stride_e_block, stride_e_slot, recent, near_from,
        MASK_CAUSAL, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_SIZE, HEAD_DIM, SPLIT, HALF_D,
        PRECISION, CODE_DTYPE, DECODE,
        K_CODE, K_BITS, K_OFFSET, K_STEP, V_CODE, V_BITS, V_OFFSET, V_STEP, EXACT,
    )  # fmt: skip

    norm = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (q_start + q_idx).to(tl.int64) * stride_o_tok + head * stride_o_head
    _store_rows(out_ptr, o_off, row_ok, acc_lo * norm, acc_hi * norm, basis_ptr,
                HEAD_DIM, SPLIT, HALF_D, ROTATE_OUT, ROTATION_CHUNK, PRECISION)  # fmt: skip


@triton.jit
def _split_len(num_keys, num_splits, MIN_SPLIT: tl.constexpr):
    """Keys per split of ``num_keys``: a multiple of MIN_SPLIT."""
    split_len = tl.cdiv(tl.cdiv(num_keys, num_splits), MIN_SPLIT) * MIN_SPLIT
    return tl.maximum(split_len, MIN_SPLIT)


@triton.jit
def _first_key(seq_len, window, HAS_WINDOW: tl.constexpr):
    """The first key a sequence's next query sees: ``window`` keys back where there is one."""
    if HAS_WINDOW:
        return tl.maximum(seq_len - window, 0)
    return seq_len * 0


@triton.jit
def _prefetch_split(
    k_head_ptr, v_head_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr, seq, split, num_splits, window,
    stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
    HAS_WINDOW: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    KEYS: tl.constexpr,
):  # fmt: skip
    """The K and V rows of the first ``KEYS`` keys of a decode split (of a plain cache, with
    no exact part) prefetched into L2 before the wait for the kernel before (``pdl_entry``):
    the past keys were written by earlier steps and the block table and lengths by the host,
    so their loads overlap that kernel's tail. A hint only: the split's own loads follow
    after the wait (the metadata read here past L1, so that no stale line is kept for them)."""
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1, cache_modifier=".cg") - tl.load(cu_seqlens_q_ptr + seq,
                                                                                 cache_modifier=".cg")  # fmt: skip
    seq_len = tl.load(seq_lens_ptr + seq, cache_modifier=".cg")
    lo = _first_key(seq_len, window, HAS_WINDOW)
    split_len = _split_len(seq_len - lo, num_splits, MIN_SPLIT)
    start = lo + split * split_len
    if q_len == 1 and start < seq_len:  # (a graph's grid has many splits past a short context: they skip it)
        keys = start + tl.arange(0, KEYS)
        read = keys < tl.minimum(start + split_len, seq_len)
        block = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=read, other=0, cache_modifier=".cg").to(tl.int64)
        slot = keys % BLOCK_SIZE
        BITS: tl.constexpr = k_head_ptr.dtype.element_ty.primitive_bitwidth
        LINE: tl.constexpr = 1024 // BITS  # elements of a 128-byte line
        LINES: tl.constexpr = triton.next_power_of_2(triton.cdiv(HEAD_DIM, LINE))
        at = tl.minimum(tl.arange(0, LINES) * LINE, HEAD_DIM - 1)[None, :]
        k_rows = k_head_ptr + (block * stride_k_block + slot * stride_k_slot)[:, None] + at
        v_rows = v_head_ptr + (block * stride_v_block + slot * stride_v_slot)[:, None] + at
        prefetch_l2(tl.where(read[:, None], k_rows, k_head_ptr))
        prefetch_l2(tl.where(read[:, None], v_rows, v_head_ptr))


@triton.jit(do_not_specialize=["num_splits", "merged_parts"])  # (one compile whatever the counts)
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_levels_ptr,
    v_levels_ptr,
    basis_ptr,
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    arrivals_ptr,
    part_counts_ptr,
    cu_seqlens_q_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    score_scale,
    cap_scale,
    window,
    ek_cache_ptr,
    ev_cache_ptr,
    shadow_tables_ptr,
    stride_e_block,
    stride_e_slot,
    stride_e_head,
    stride_st,
    recent,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    stride_bt,
    num_heads,
    num_splits,
    merged_parts,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    HALF_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    PARTIAL: tl.constexpr,
    MERGE: tl.constexpr,
    REDUCE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    PRECISION: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    DECODE: tl.constexpr,
    K_CODE: tl.constexpr,
    K_BITS: tl.constexpr,
    K_OFFSET: tl.constexpr,
    K_STEP: tl.constexpr,
    V_CODE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_OFFSET: tl.constexpr,
    V_STEP: tl.constexpr,
    ROTATE_OUT: tl.constexpr,
    ROTATION_CHUNK: tl.constexpr,
    EXACT: tl.constexpr,
    EXACT_PART: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    kv_head = tl.program_id(0)  # fastest: every KV head of a sequence before the next one
    seq = tl.program_id(1)
    split = tl.program_id(2)
    if PREFETCH:
        _prefetch_split(k_cache_ptr + kv_head * stride_k_head, v_cache_ptr + kv_head * stride_v_head,
                        block_tables_ptr + seq.to(tl.int64) * stride_bt, cu_seqlens_q_ptr, seq_lens_ptr, seq, split,
                        num_splits, window, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
                        HAS_WINDOW, MIN_SPLIT, BLOCK_SIZE, HEAD_DIM, MIN_SPLIT)  # fmt: skip
    pdl_entry(PDL)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_len != 1:  # padding, or a prompt chunk: the prefill kernel's
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = _first_key(seq_len, window, HAS_WINDOW)
    # With a recent window (EXACT) the splits share the plain keys between them and a
    # launch of its own (EXACT_PART, the part after the splits that ran) reads the exact
    # spans (the first block, the last ``recent`` keys): in the splits' launch its tiles
    # cost every program registers (spills at 64 x 8k), and in the last split they
    # lengthened the step's slowest program by a third.
    near_from = seq_len - recent
    plain_lo, plain_hi = lo, seq_len
    if EXACT:
        plain_lo, plain_hi = _exact_spans(lo, seq_len, near_from, BLOCK_SIZE)
    head_end = plain_lo  # the exact part's first span: [lo, head_end)
    if EXACT and not HAS_WINDOW:
        # The splits start at a whole tile, as without the window, and the exact part
        # takes the rest of the first one: tiles at multiples of BLOCK_N load their
        # block-table entries as vectors (from a start known only to be a block's,
        # fp8's kernel took 187 registers instead of 168, and 7 % more instructions).
        plain_lo = BLOCK_N
        head_end = tl.minimum(plain_hi, BLOCK_N)
    plain_keys = tl.maximum(plain_hi - plain_lo, 0)
    split_len = _split_len(plain_keys, num_splits, MIN_SPLIT)
    # The splits this context fills (split 0 always); the grid's others exit at once, so a
    # short context in a graph captured for long ones reads and merges a few parts only.
    used = tl.maximum(tl.cdiv(plain_keys, split_len), 1)
    if EXACT_PART:
        split = used  # the exact part follows the splits that ran
    elif split >= used:
        return
    start = plain_lo + split * split_len
    end = tl.maximum(tl.minimum(start + split_len, plain_hi), start)  # (empty splits leave neutral partials)
    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    a_lo, a_hi, b_lo, b_hi = start, full_end, full_end, end
    if EXACT_PART:
        a_lo, a_hi, b_lo, b_hi = lo, head_end, plain_hi, seq_len

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    q_off = q_start.to(tl.int64) * stride_q_tok + head * stride_q_head
    q_lo, q_hi = _load_queries(q_ptr, q_off, row_ok, HEAD_DIM, SPLIT, HALF_D)
    q_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    q_lim = q_pos  # (one query sees up to itself: an image's tokens are never a one-query chunk)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF_D], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kv_head * stride_k_head
    v_head = v_cache_ptr + kv_head * stride_v_head
    k_scale_head = k_scale_ptr + kv_head * stride_s_head
    v_scale_head = v_scale_ptr + kv_head * stride_s_head
    ek_head = ek_cache_ptr + kv_head * stride_e_head
    ev_head = ev_cache_ptr + kv_head * stride_e_head
    shadow_table = shadow_tables_ptr + seq.to(tl.int64) * stride_st
    # [a_lo, a_hi): a split's whole tiles, or the exact part's head (the first block, then
    # one whole tile up to the first split, hiding the keys past it); [b_lo, b_hi): a
    # split's last tile, or the exact part's recent keys
    acc_lo, acc_hi, l_i, m_i = _attend_keys(
        acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, q_pos, q_lim, a_lo, a_hi,
        k_head, v_head, k_scale_head, v_scale_head, k_levels_ptr, v_levels_ptr, block_table,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, stride_s_block, stride_s_slot,
        score_scale, cap_scale, window, ek_head, ev_head, shadow_table, stride_e_block, stride_e_slot, recent, near_from,
        MASK_NONE, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_SIZE, HEAD_DIM, SPLIT, HALF_D,
        PRECISION, CODE_DTYPE, DECODE,
        K_CODE, K_BITS, K_OFFSET, K_STEP, V_CODE, V_BITS, V_OFFSET, V_STEP, EXACT_PART,
    )  # fmt: skip
    acc_lo, acc_hi, l_i, m_i = _attend_keys(
        acc_lo, acc_hi, l_i, m_i, q_lo, q_hi, q_pos, q_lim, b_lo, b_hi,
        k_head, v_head, k_scale_head, v_scale_head, k_levels_ptr, v_levels_ptr, block_table,
        stride_k_block, stride_k_slot, stride_v_block, stride_v_slot, stride_s_block, stride_s_slot,
        score_scale, cap_scale, window, ek_head, ev_head, shadow_table, stride_e_block, stride_e_slot, recent, near_from,
        MASK_BOUNDS, HAS_WINDOW, HAS_SOFTCAP, BLOCK_N, BLOCK_SIZE, HEAD_DIM, SPLIT, HALF_D,
        PRECISION, CODE_DTYPE, DECODE,
        K_CODE, K_BITS, K_OFFSET, K_STEP, V_CODE, V_BITS, V_OFFSET, V_STEP, EXACT_PART,
    )  # fmt: skip

    # Rotating back is linear: split partials stay in the rotated basis, and the reduce
    # rotates their merge once per (token, head).
    if not PARTIAL:  # one part: the output itself
        norm = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = q_start.to(tl.int64) * stride_o_tok + head * stride_o_head
        _store_rows(out_ptr, o_off, row_ok, acc_lo * norm, acc_hi * norm, basis_ptr,
                    HEAD_DIM, SPLIT, HALF_D, ROTATE_OUT, ROTATION_CHUNK, PRECISION)  # fmt: skip
    else:
        # parts: the splits, the exact one
        part = (seq.to(tl.int64) * num_heads + head) * (num_splits + EXACT) + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        _store_rows(part_acc_ptr, part * HEAD_DIM, row_ok, acc_lo, acc_hi, basis_ptr,
                    HEAD_DIM, SPLIT, HALF_D, False, ROTATION_CHUNK, PRECISION)  # fmt: skip
        # Up to merged_parts parts, the last of the (sequence, KV head) to finish merges them
        # (past it, the reduce launch does; a short context in a graph captured for long
        # ones merges here and the reduce's programs exit at once)
        parts_run = used + EXACT
        if MERGE:  # noqa: SIM102 (a constexpr: no atomic is compiled without it)
            if parts_run <= merged_parts:  # noqa: SIM102 (no atomic past it: `and` would count every program)
                if last_to_arrive(arrivals_ptr + seq * (num_heads // GROUP) + kv_head, parts_run):
                    first_part = (seq.to(tl.int64) * num_heads + head) * (num_splits + EXACT)
                    o_off = q_start.to(tl.int64) * stride_o_tok + head * stride_o_head
                    _merge_parts(out_ptr, o_off, part_acc_ptr, part_max_ptr, part_sum_ptr, first_part, parts_run,
                                 row_ok, basis_ptr, BLOCK_M, HEAD_DIM, SPLIT, HALF_D, ROTATE_OUT, ROTATION_CHUNK,
                                 PRECISION)  # fmt: skip
        if REDUCE:  # noqa: SIM102 (a constexpr)
            if split == 0 and kv_head == 0 and not EXACT_PART:  # the reduce's count of the parts
                tl.store(part_counts_ptr + seq, parts_run)


@triton.jit
def _merge_parts(
    out_ptr, o_off, part_acc_ptr, part_max_ptr, part_sum_ptr, first_part, num_parts, row_ok, basis_ptr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, HALF_D: tl.constexpr,
    ROTATE_OUT: tl.constexpr, ROTATION_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The output rows merged from their ``num_parts`` partials (acc, max, sum) from
    ``first_part`` on, as :func:`_decode_reduce_kernel` does, online over the parts."""
    cols, lo_ok, hi_ok = half_columns(HEAD_DIM, SPLIT, HALF_D)
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_lo = tl.zeros([BLOCK_M, HALF_D], tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF_D], tl.float32)
    for p in range(0, num_parts):
        part = first_part + p
        m_p = tl.load(part_max_ptr + part, mask=row_ok, other=NEG_BIG, cache_modifier=".cg")
        l_p = tl.load(part_sum_ptr + part, mask=row_ok, other=0.0, cache_modifier=".cg")
        read = row_ok & (l_p > 0.0)  # (a part that read no keys holds nothing)
        at = part_acc_ptr + part[:, None] * HEAD_DIM + cols[None, :]
        lo = tl.load(at, mask=read[:, None] & lo_ok[None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_p)
        alpha, beta = tl.exp2(m_i - m_new), tl.exp2(m_p - m_new)
        l_i = l_i * alpha + l_p * beta
        acc_lo = acc_lo * alpha[:, None] + lo * beta[:, None]
        if SPLIT < HEAD_DIM:  # a second half
            hi = tl.load(at + SPLIT, mask=read[:, None] & hi_ok[None, :], other=0.0, cache_modifier=".cg")
            acc_hi = acc_hi * alpha[:, None] + hi * beta[:, None]
        m_i = m_new
    norm = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    _store_rows(out_ptr, o_off, row_ok, acc_lo * norm, acc_hi * norm, basis_ptr,
                HEAD_DIM, SPLIT, HALF_D, ROTATE_OUT, ROTATION_CHUNK, PRECISION)  # fmt: skip


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    part_acc_ptr,
    basis_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_counts_ptr,
    cu_seqlens_q_ptr,
    stride_o_tok,
    stride_o_head,
    num_heads,
    merged_parts,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    BLOCK_PARTS: tl.constexpr,
    ROTATE_OUT: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_len != 1:
        return

    num_parts = tl.load(part_counts_ptr + seq)  # the parts that ran (_decode_kernel's used splits)
    if num_parts <= merged_parts:  # merged by the decode launch's last program
        return
    # (a part that read no keys left max NEG_BIG, sum and acc 0: it weighs nothing)
    parts = tl.arange(0, BLOCK_PARTS)
    active = parts < num_parts
    part = (seq.to(tl.int64) * num_heads + head) * NUM_PARTS + parts
    m = tl.load(part_max_ptr + part, mask=active, other=NEG_BIG)
    total = tl.load(part_sum_ptr + part, mask=active, other=0.0)
    weight = tl.where(active, tl.exp2(m - tl.max(m, 0)), 0.0)
    denom = tl.sum(weight * total, 0)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    acc_mask = active[:, None] & d_ok[None, :]
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=acc_mask, other=0.0)
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(denom == 0.0, 1.0, denom)
    if ROTATE_OUT:  # back in the model's basis: out @ signsᵀ / sqrt(D)
        signs = tl.load(
            basis_ptr + dims[:, None] * HEAD_DIM + dims[None, :], mask=d_ok[:, None] & d_ok[None, :], other=0
        )
        out = tl.sum(signs.to(tl.float32) * out[None, :], 1) * (1.0 / HEAD_DIM**0.5)
    o_off = q_start.to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_off + dims, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # rows of a tile: (query, head) pairs
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int


# Up to this many splits (that a context fills) the last of a (sequence, KV head)'s programs
# merges their partials (a serial loop over the parts) instead of the reduce; past it the
# reduce's programs per (sequence, head) merge faster than the one program would.
MERGE_SPLITS = 8

# Preferred first; the first whose shared memory fits the device is used. Sizes checked
# by compiling for sm_80 and sm_90 (no spills).
_PREFILL_TILES = {
    64: [TileConfig(128, 64, 8, 2), TileConfig(64, 32, 4, 2)],
    128: [TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2), TileConfig(64, 32, 4, 1)],
    256: [TileConfig(64, 32, 8, 2), TileConfig(64, 32, 8, 1), TileConfig(32, 32, 4, 1)],
}
_DECODE_TILES = {
    64: [TileConfig(16, 64, 4, 2)],
    128: [TileConfig(16, 64, 4, 2), TileConfig(16, 32, 4, 2)],
    256: [TileConfig(16, 32, 4, 2), TileConfig(16, 16, 4, 1)],
}
# Quantized tiles are fewer bytes and more instructions: where (sequence, KV head)
# pairs alone fill the multiprocessors, longer tiles (H200 sweep at 64 x 8k; at batch 1
# the plain tiles' shorter splits win).
_LONG_DECODE_TILES = {
    64: [TileConfig(16, 128, 4, 2)],
    128: [TileConfig(16, 128, 4, 2), TileConfig(16, 64, 4, 2)],
    256: [TileConfig(16, 64, 4, 2), TileConfig(16, 32, 4, 2)],
}
# Dots on the FMA units (before sm_80, or fp32 in "ieee" precision) need small tiles to
# stay out of register spills.
_FMA_TILES = TileConfig(16, 16, 4, 1)
_INTERPRETER_TILES = TileConfig(16, 16, 4, 1)  # small tiles, so small tests cross tiles


@functools.cache
def _device_limits(index: int) -> tuple[int, int, int]:
    """(compute capability major, multiprocessors, shared memory per block in bytes)."""
    props = triton.runtime.driver.active.utils.get_device_properties(index)
    major, _ = torch.cuda.get_device_capability(index)
    return major, props["multiprocessor_count"], props["max_shared_mem"]


def _shared_bytes(cfg: TileConfig, head_dim: int, elem_size: int) -> int:
    # Q tile plus num_stages K and V tiles; an upper bound of what Triton allocates.
    block_d = triton.next_power_of_2(head_dim)
    return (cfg.num_stages * 2 * cfg.block_n + cfg.block_m) * block_d * elem_size


def _pick(table: dict[int, list[TileConfig]], head_dim: int, q: Tensor) -> TileConfig:
    if q.device.type != "cuda":
        return _INTERPRETER_TILES
    major, _, max_shared = _device_limits(q.device.index or 0)
    if major < 8 or q.dtype == torch.float32:
        return _FMA_TILES
    candidates = table[min(d for d in table if d >= min(head_dim, 256))]
    for cfg in candidates:
        if _shared_bytes(cfg, head_dim, q.element_size()) <= max_shared:
            return cfg
    return _FMA_TILES


def prefill_config(head_dim: int, q: Tensor) -> TileConfig:
    return _pick(_PREFILL_TILES, head_dim, q)


def long_tiles_fit(sides: tuple[Side, Side], major: int) -> bool:
    """Whether a quantized cache decodes with :data:`_LONG_DECODE_TILES` on a device of
    compute capability ``major``: Lloyd–Max level chains spill there before sm_90
    (compile_check: 520-832 B at sm_80)."""
    quantized = any(s.code != PLAIN for s in sides)
    return quantized and not (major < 9 and any(s.code == LLOYD for s in sides))


def decode_config(head_dim: int, q: Tensor, long_tiles: bool = False) -> TileConfig:
    return _pick(_LONG_DECODE_TILES if long_tiles else _DECODE_TILES, head_dim, q)


def _min_split(cfg: TileConfig) -> int:
    """The fewest keys a decode split takes: two tiles."""
    return max(2 * cfg.block_n, 64)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return _device_limits(device.index or 0)[1]


_PROGRAMS_PER_SM: dict[tuple, int] = {}  # (kernel, device and dtypes, constexprs) -> programs


def _programs_per_sm(kernel: triton.JITFunction, args: Callable[[], tuple], kind: tuple, constexprs: dict) -> int:
    """How many programs of ``kernel`` compiled for ``args()`` one multiprocessor holds at
    once: by registers (64K, allocated per warp in units of 256), by shared memory, and
    by warps (64). ``kind`` (device and tensor dtypes) and ``constexprs`` tell compiles
    apart, so the arguments are built only on a first call."""
    key = (kernel, *kind, *sorted(constexprs.items()))
    if key not in _PROGRAMS_PER_SM:
        call_args = args()
        compiled = kernel.warmup(*call_args, grid=(1,), **constexprs)
        compiled._init_handles()  # (loads it: registers are known from here)
        device = next(a.device for a in call_args if isinstance(a, Tensor))
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        warps = compiled.metadata.num_warps
        by_registers = props["max_num_regs"] // (triton.cdiv(compiled.n_regs * 32, 256) * 256) // warps
        by_shared = (props["max_shared_mem"] + 1024) // (compiled.metadata.shared + 1024)
        _PROGRAMS_PER_SM[key] = max(1, min(by_registers, by_shared, 64 // warps))
    return _PROGRAMS_PER_SM[key]


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: Tensor | None = None,
    num_splits: int | None = None,
    prefill_tiles: TileConfig | None = None,
    decode_tiles: TileConfig | None = None,
) -> Tensor:
    """Causal paged attention of ``q`` [T, H, D] over caches [num_blocks, block_size, Hkv, D].

    ``num_splits`` overrides the decode split count; the tile configs
    override the defaults (for tests and tuning).
    """
    return paged_attention_cache(
        q, LayerKVCache.plain(k_cache, v_cache), meta, scale, window, softcap,
        out=out, num_splits=num_splits, prefill_tiles=prefill_tiles, decode_tiles=decode_tiles,
    )  # fmt: skip


def paged_attention_cache(
    q: Tensor,
    cache: LayerKVCache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    rotated_q: Tensor | None = None,
    **overrides,
) -> Tensor:
    """:func:`paged_attention` over a layer's cache in any format: quantized K/V tiles are
    decoded in registers inside the loop (``decode=`` overrides the device's decode
    method, :func:`~xinfer_cuda.kernels.kv_codes.decode_method`). Where the format
    rotates keys the kernels read the queries in the keys' basis: ``rotated_q=`` from
    the step's write launch (:func:`~xinfer_cuda.kernels.kv_quant_write.quant_write_kv`),
    else rotated here first; where it rotates values they rotate the output back."""
    fmt = cache.format
    k_side, v_side = side(cache, "k", fmt.key), side(cache, "v", fmt.value)
    if fmt.rotate_keys:
        if "out" not in overrides:  # in the model's dtype, not the rotated queries'
            overrides["out"] = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q = rotate_queries(q, cache) if rotated_q is None else rotated_q
    out_basis = signed_basis(cache.head_dim, q.device) if fmt.rotate_values else None
    exact = None
    if cache.shadows is not None and meta.shadows is not None:
        exact = ExactWindow(*cache.shadows, meta.shadows.tables, cache.recent_window)
    return attend_sides(q, k_side, v_side, meta, scale, window, softcap, out_basis=out_basis, exact=exact, **overrides)


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _fork(device: torch.device) -> torch.cuda.Stream | None:
    """A second stream that has waited for the current one's work so far (CUDA graph
    captures follow it), or None off the GPU; the caller joins it back."""
    if device.type != "cuda":
        return None
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def _row_split(block_d: int, halves: bool) -> dict:
    """The kernels' SPLIT and HALF_D for rows in halves or whole (:func:`half_columns`)."""
    split = block_d // 2 if halves else block_d
    return dict(SPLIT=split, HALF_D=max(split, 16))


@dataclass(frozen=True)
class ExactWindow:
    """A quantized cache's recent window as the kernels read it: each sequence's keys
    within ``recent`` of a query, and its first block, from the shadow blocks where it
    has them (:meth:`xinfer.ops.Ops.attention`)."""

    k: Tensor  # [num_shadows, block_size, Hkv, D], model dtype, the stored basis
    v: Tensor
    tables: Tensor  # [B, max_blocks] int32, -1: no shadow
    recent: int

    def args(self) -> tuple:
        assert self.k.stride() == self.v.stride(), "K and V shadows must share a layout"
        return (self.k, self.v, self.tables, *self.k.stride()[:3], self.tables.stride(0), self.recent)


def attend_sides(
    q: Tensor,
    k_side: Side,
    v_side: Side,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: Tensor | None = None,
    num_splits: int | None = None,
    prefill_tiles: TileConfig | None = None,
    decode_tiles: TileConfig | None = None,
    out_basis: Tensor | None = None,
    decode: int | None = None,
    halves: bool | None = None,
    exact: ExactWindow | None = None,
    prefetch: bool | None = None,
) -> Tensor:
    """Attention of ``q`` over the sides' caches as they are stored: queries already in
    the keys' basis, and with ``out_basis`` (the rotation's signs, for rotated values)
    the output rotated back. ``prefetch`` overrides whether decode splits prefetch their
    keys before waiting for the kernel before (:func:`_prefetch_split`), for A/B timing."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    k_cache, v_cache = k_side.data, v_side.data
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    has_window = window is not None
    has_softcap = softcap is not None and softcap > 0
    # s -> s * scale, or with a cap: cap * tanh(s * scale / cap); both then times log2(e).
    score_scale = scale / softcap if has_softcap else scale * LOG2E
    cap_scale = softcap * LOG2E if has_softcap else 0.0
    block_d = triton.next_power_of_2(head_dim)
    sides = (k_side, v_side)
    quantized = any(s.code != PLAIN for s in sides)
    packed = any(s.bits < 8 for s in sides)  # 4- or 3-bit codes: laid out for rows in halves
    num_sms = _num_sms(q.device)
    fills_gpu = meta.num_seqs * num_kv_heads >= num_sms
    # Rows in halves where a side packs codes (see _attend_keys), and for other quantized
    # caches in decode at batches that leave multiprocessors idle (H200: fp8 at 1 x 32k
    # 38 us a layer in halves, 53 whole; at 64 x 8k 394 in halves, 355 whole); whole
    # otherwise. ``halves`` overrides it for A/B timing where codes are not packed.
    if halves is None:
        prefill_halves, decode_halves = packed, packed or (quantized and not fills_gpu)
    else:
        prefill_halves = decode_halves = packed or halves
    common = dict(
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HAS_WINDOW=has_window,
        HAS_SOFTCAP=has_softcap,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    scales = k_side.scale_or_data()
    assert v_side.scale_or_data().stride() == scales.stride(), "K and V scales must share a layout"
    cache_strides = (*k_cache.stride()[:3], *v_cache.stride()[:3], *scales.stride()[:3], meta.block_tables.stride(0))
    cache_ptrs = (
        k_cache,
        v_cache,
        k_side.scale_or_data(),
        v_side.scale_or_data(),
        k_side.levels_or_data(),
        v_side.levels_or_data(),
    )
    if k_side.code != PLAIN or v_side.code != PLAIN:
        assert head_dim & (head_dim - 1) == 0, f"quantized caches need a power-of-two head_dim, got {head_dim}"
    # Quantized tiles are built as fp16 bit patterns (bit operations, no conversions);
    # fp32 queries (tests, pre-sm_80 fallbacks) keep fp32 tiles.
    magic = q.dtype != torch.float32
    decode = decode_method(q.device) if decode is None else decode
    common |= dict(CODE_DTYPE=tl.float16 if magic else tl.float32, DECODE=decode)
    common |= k_side.constexprs("K", magic, decode) | v_side.constexprs("V", magic, decode)
    common |= dict(ROTATE_OUT=out_basis is not None, ROTATION_CHUNK=min(ROTATION_CHUNK, head_dim))
    basis = out_basis if out_basis is not None else q  # (q stands in where there is none)
    window_arg = window if has_window else 0
    # (q and the block tables stand in for the shadows where there is no window)
    exact_args = exact.args() if exact is not None else (q, q, meta.block_tables, 0, 0, 0, 0, 0)
    pdl = launch.pdl(q.device)
    common |= dict(EXACT=exact is not None) | pdl

    if meta.max_seqlen_q > 1:
        cfg = prefill_tiles or prefill_config(head_dim, q)
        if k_side.code == LLOYD and prefill_tiles is None:
            # Level lookups leave fewer registers: half the keys per step.
            cfg = replace(cfg, block_n=max(cfg.block_n // 2, 16))
        block_m = max(cfg.block_m, triton.next_power_of_2(group))
        q_per_tile = block_m // group
        # Tiles from shapes only (graph-safe): the last sequence's tiles end before
        # T // q_per_tile + num_seqs (see tile_owner); programs past a sequence's
        # queries exit at once.
        grid = (num_tokens // q_per_tile + meta.num_seqs, num_kv_heads)
        _prefill_kernel[grid](
            q, *cache_ptrs, basis, out,
            meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.num_seqs,
            meta.key_limits if meta.key_limits is not None else meta.seq_lens, score_scale, cap_scale, window_arg, *exact_args,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *cache_strides,
            GROUP=group, Q_PER_TILE=q_per_tile, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
            HAS_LIMITS=meta.key_limits is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common, **_row_split(block_d, prefill_halves),
        )  # fmt: skip

    major = _device_limits(q.device.index or 0)[0] if q.is_cuda else 9
    max_context = meta.block_tables.shape[1] * block_size
    # Quantized caches take long tiles where the (sequence, KV head) pairs fill the
    # multiprocessors, or where each pair's context fills a wave of long-tile splits; the
    # latter in one wave (H200, one layer at 1 x 32k: turbo3 84 -> 52 us, turbo4 44 -> 42,
    # turbo8 46 -> 44, fp8 38 -> 37; at 1 x 1k short tiles stay faster).
    one_wave = triton.cdiv(num_sms, meta.num_seqs * num_kv_heads)
    long_context = max_context >= one_wave * _min_split(decode_config(head_dim, q, long_tiles=True))
    long_tiles = long_tiles_fit(sides, major) and (fills_gpu or long_context)
    cfg = decode_tiles or decode_config(head_dim, q, long_tiles)
    block_m = max(cfg.block_m, triton.next_power_of_2(group))
    min_split = _min_split(cfg)
    if prefetch is None:  # (where there is a kernel before to overlap, and plain rows)
        prefetch = pdl["PDL"] and not quantized and exact is None
    decode_constexprs = dict(
        GROUP=group, BLOCK_M=block_m, BLOCK_N=cfg.block_n, MIN_SPLIT=min_split, PREFETCH=prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **common, **_row_split(block_d, decode_halves),
    )  # fmt: skip

    def decode_args(
        part_acc: Tensor,
        part_max: Tensor,
        part_sum: Tensor,
        counters: Tensor,
        part_counts: Tensor,
        num_splits: int,
        merged_parts: int,
    ) -> tuple:
        return (
            q, *cache_ptrs, basis, out, part_acc, part_max, part_sum, counters, part_counts,
            meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
            score_scale, cap_scale, window_arg, *exact_args,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *cache_strides, num_heads, num_splits, merged_parts,
        )  # fmt: skip

    if num_splits is None and long_tiles and not fills_gpu and q.is_cuda:
        # One wave of as many programs as the multiprocessors hold at once, which the
        # compiled kernel's registers and shared memory say, less the exact part's
        # programs (H200, one layer at 1 x 32k, 3 programs a multiprocessor, 49 splits
        # against 32: turbo4 38.0 -> 33.6 us, turbo8 42.4 -> 37.4, fp8 38.7 -> 36.7).
        def stand_in_args() -> tuple:  # (the partials' dtype and alignment)
            stand_in = torch.empty(1, dtype=torch.float32, device=q.device)
            counts = torch.empty(1, dtype=torch.int32, device=q.device)
            return decode_args(stand_in, stand_in, stand_in, counts, counts, 2, 0)

        kind = (q.device, q.dtype, k_cache.dtype, v_cache.dtype)  # (the other dtypes follow from the constexprs)
        constexprs = dict(decode_constexprs, EXACT_PART=False, PARTIAL=True, MERGE=False, REDUCE=True)
        per_sm = _programs_per_sm(_decode_kernel, stand_in_args, kind, constexprs)
        useful = triton.cdiv(max_context, min_split)
        pairs = meta.num_seqs * num_kv_heads
        exact_programs = pairs if exact is not None else 0
        num_splits = max(1, min((per_sm * num_sms - exact_programs) // pairs, useful, MAX_SPLITS))
    elif num_splits is None:
        waves = 1 if long_tiles and not fills_gpu else 4 if quantized else 2
        num_splits = decode_num_splits(meta.num_seqs, num_kv_heads, max_context, num_sms, min_split, waves)
    num_parts = num_splits + (exact is not None)  # the exact part, with a recent window
    if num_parts > 1:
        part_shape = (meta.num_seqs, num_heads, num_parts)
        parts = (
            torch.empty((*part_shape, head_dim), dtype=torch.float32, device=q.device),
            torch.empty(part_shape, dtype=torch.float32, device=q.device),
            torch.empty(part_shape, dtype=torch.float32, device=q.device),
        )
    else:
        parts = (out, out, out)  # unused
    # The last program of a (sequence, KV head) merges up to MERGE_SPLITS splits (and the
    # exact part); a grid of more launches the reduce too, which merges the contexts that
    # filled more of them.
    counters = arrivals.counters(q.device, "attention", meta.num_seqs * num_kv_heads) if num_parts > 1 else None
    reduce = num_parts > 1 and (counters is None or num_splits > MERGE_SPLITS)
    merged_parts = 0 if counters is None else MERGE_SPLITS + (exact is not None) if reduce else num_parts
    part_counts = torch.empty(meta.num_seqs, dtype=torch.int32, device=q.device) if reduce else meta.seq_lens
    counters_arg = counters if counters is not None else meta.seq_lens  # (unused without)
    args = decode_args(*parts, counters_arg, part_counts, num_splits, merged_parts)
    decode_constexprs |= dict(PARTIAL=num_parts > 1, MERGE=counters is not None, REDUCE=reduce)
    side = _fork(q.device) if exact is not None else None
    if exact is not None:  # the exact part, beside the splits where there are streams
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            _decode_kernel[(num_kv_heads, meta.num_seqs, 1)](*args, EXACT_PART=True, **decode_constexprs)
    _decode_kernel[(num_kv_heads, meta.num_seqs, num_splits)](*args, EXACT_PART=False, **decode_constexprs)
    if side is not None:
        torch.cuda.current_stream(q.device).wait_stream(side)
    if reduce:
        _decode_reduce_kernel[(meta.num_seqs, num_heads)](
            out, parts[0], basis, parts[1], parts[2], part_counts, meta.cu_seqlens_q,
            out.stride(0), out.stride(1), num_heads, merged_parts,
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_PARTS=num_parts, BLOCK_PARTS=triton.next_power_of_2(num_parts),
            ROTATE_OUT=common["ROTATE_OUT"], num_warps=4, **pdl,
        )  # fmt: skip
    return out
