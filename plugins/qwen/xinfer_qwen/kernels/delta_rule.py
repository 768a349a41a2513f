"""The gated delta rule (:func:`xinfer_qwen.deltanet_ops.gated_delta_rule` is its reference):
a recurrent kernel for decode steps, the chunked form for steps with prompts.

Recurrent: one program per (sequence, value head, Dv tile) keeps its tile of the state in
registers and steps through the sequence's rows, computing each row's decay and write
strength from the projections ``a`` and ``b`` where it reads them (at batch 1 their half a
dozen elementwise launches cost more than the kernel).

Chunked (chunks of C = 64 rows, as flash-linear-attention's ``chunk_gated_delta_rule``): in
a chunk starting from state S0, with ``G_i`` the cumulative log decay up to row i and
``D_ij = exp(G_i - G_j)`` (j <= i), the rows' corrections ``d_i = beta_i (v_i - (exp(g_i) S_{i-1})^T k_i)``
solve the unit lower-triangular system

    d_i + sum_{j<i} beta_i (k_i . k_j) D_ij d_j = beta_i (v_i - exp(G_i) S0^T k_i),   i.e. (I + A) d = r,

and then, with no recurrence left inside the chunk,

    o_i = exp(G_i) S0^T q_i + sum_{j<=i} (q_i . k_j) D_ij d_j
    S   = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j d_j^T.

:func:`_inverse_kernel` forms ``(I + A)^-1`` of every chunk at once (it does not depend on
the state); :func:`_chunk_kernel` then walks each sequence's chunks in order, one program
per (sequence, value head, Dv tile), all in matrix products. Every exponent is <= 0.

Where flash-linear-attention imports, a step with at least a chunk's rows per sequence goes to
its chunked kernels instead (:mod:`.fla_prefill` says why and when).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import helpers, launch_chain
from xinfer.ops import AttentionMetadata
from xinfer_qwen.kernels import fla_prefill
from xinfer_qwen.kernels.gated_norm import gated_rms_norm, gated_rms_norm_head

CHUNK = 64
RECURRENT_BLOCK_V = 32
CHUNK_BLOCK_V = 32


@triton.jit
def _l2_normalized(x):
    """Rows of ``x`` [R, D] (or ``x`` [D]) over their last dim divided by their L2 norm."""
    return x * tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6)


@triton.jit
def _gates(a, b, a_log, dt_bias):
    """The log decay ``-exp(A_log) * softplus(a + dt_bias)`` and the write strength ``sigmoid(b)``
    (fp32), as :func:`xinfer_qwen.deltanet_ops.gates` (torch's softplus: linear past 20)."""
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return -tl.exp(a_log) * softplus, tl.sigmoid(b)


@triton.jit
def _gates_kernel(
    a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, tokens, heads, stride_a_t, stride_b_t,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, ENTER: tl.constexpr,
):  # fmt: skip
    """:func:`_gates` of rows ``a``, ``b`` [T, H] into ``g``, ``beta`` [T, H] (fp32, contiguous)."""
    ENTER()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    hs = tl.arange(0, BLOCK_H)
    mask = (rows < tokens)[:, None] & (hs < heads)[None, :]
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a_t + hs[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None].to(tl.int64) * stride_b_t + hs[None, :], mask=mask, other=0.0).to(tl.float32)
    a_log = tl.load(a_log_ptr + hs, mask=hs < heads, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + hs, mask=hs < heads, other=0.0).to(tl.float32)
    g, beta = _gates(a, b, a_log[None, :], dt_bias[None, :])
    out = rows[:, None].to(tl.int64) * heads + hs[None, :]
    tl.store(g_ptr + out, g, mask=mask)
    tl.store(beta_ptr + out, beta, mask=mask)


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, out_ptr, cu_seqlens_ptr, seq_lens_ptr,
    slots_ptr, stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_a_t, stride_b_t,
    stride_o_t, stride_o_h, stride_s_slot, stride_s_h, stride_s_k, dim_k, dim_v, scale,
    z_ptr, norm_weight_ptr, normed_ptr, counters_ptr, stride_z_t, stride_z_h, eps,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, NORM: tl.constexpr, BLOCK_DV: tl.constexpr,
    LAST_TO_ARRIVE: tl.constexpr, ENTER: tl.constexpr,
):  # fmt: skip
    """One (sequence, value head, Dv tile); with ``NORM`` (one row a sequence) the last of a head's
    tiles to store its output reads the whole head back and stores its gated RMSNorm in ``normed``."""
    ENTER()
    seq, head = tl.program_id(0), tl.program_id(1)
    lo, hi = tl.load(cu_seqlens_ptr + seq).to(tl.int64), tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    if hi == lo:
        return
    continues = tl.load(seq_lens_ptr + seq) != hi - lo
    a_log, dt_bias = tl.load(a_log_ptr + head).to(tl.float32), tl.load(dt_bias_ptr + head).to(tl.float32)
    k_head = head // GROUP
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = ks < dim_k, vs < dim_v
    state_ptrs = (state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_s_slot + head * stride_s_h
                  + ks[:, None] * stride_s_k + vs[None, :])  # fmt: skip
    tile_mask = k_mask[:, None] & v_mask[None, :]
    read_mask = (ks < tl.where(continues, dim_k, 0))[:, None] & v_mask[None, :]  # nothing unless it continues
    s = tl.load(state_ptrs, mask=read_mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    for t in range(lo, hi):
        q = tl.load(q_ptr + t * stride_q_t + k_head * stride_q_h + ks, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * stride_k_t + k_head * stride_k_h + ks, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_v_t + head * stride_v_h + vs, mask=v_mask, other=0.0).to(tl.float32)
        q, k = _l2_normalized(q) * scale, _l2_normalized(k)
        a = tl.load(a_ptr + t * stride_a_t + head).to(tl.float32)
        g, beta = _gates(a, tl.load(b_ptr + t * stride_b_t + head).to(tl.float32), a_log, dt_bias)
        s *= tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))
        s += k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + t * stride_o_t + head * stride_o_h + vs, o.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(state_ptrs, s.to(state_ptr.dtype.element_ty), mask=tile_mask)
    if NORM:  # noqa: SIM102 (a constexpr: no atomic is compiled without it)
        if LAST_TO_ARRIVE(counters_ptr + seq * tl.num_programs(1) + head, tl.num_programs(2)):
            cols = tl.arange(0, BLOCK_DV)
            mask = cols < dim_v
            x = tl.load(
                out_ptr + lo * stride_o_t + head * stride_o_h + cols, mask=mask, other=0.0, cache_modifier=".cg"
            )
            z = tl.load(z_ptr + lo * stride_z_t + head * stride_z_h + cols, mask=mask, other=0.0).to(tl.float32)
            weight = tl.load(norm_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            normed = gated_rms_norm_head(x, z, weight, dim_v, eps)
            tl.store(normed_ptr + (lo * tl.num_programs(1) + head) * dim_v + cols,
                     normed.to(normed_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def _load_rows(ptr, start, hi, stride_t, width, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Rows ``start:start + ROWS`` [ROWS, COLS] (fp32) of a [T, width] matrix at ``ptr`` with row
    stride ``stride_t``; zeros past row ``hi`` and column ``width``."""
    rows, cols = tl.arange(0, ROWS), tl.arange(0, COLS)
    mask = (rows < hi - start)[:, None] & (cols < width)[None, :]
    rows_ptr = ptr + start * stride_t + (rows * stride_t)[:, None]
    return tl.load(rows_ptr + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _chunk_rows(k_ptr, g_ptr, beta_ptr, start, hi, k_head, head, stride_k_t, stride_k_h, stride_g_t, stride_beta_t,
                dim_k, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):  # fmt: skip
    """A chunk's normalized keys [CHUNK, BLOCK_K], cumulative log decays and betas [CHUNK];
    zeros past the sequence's end."""
    rows = start + tl.arange(0, CHUNK)
    in_seq = rows < hi
    k = _load_rows(k_ptr + k_head * stride_k_h, start, hi, stride_k_t, dim_k, CHUNK, BLOCK_K)
    g = tl.load(g_ptr + rows * stride_g_t + head, mask=in_seq, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_beta_t + head, mask=in_seq, other=0.0).to(tl.float32)
    return _l2_normalized(k), tl.cumsum(g, axis=0), beta


@triton.jit
def _decays(cum_g, CHUNK: tl.constexpr, INCLUSIVE: tl.constexpr):
    """``exp(G_i - G_j)`` [CHUNK, CHUNK] where j <= i (j < i unless ``INCLUSIVE``), else 0."""
    i = tl.arange(0, CHUNK)[:, None]
    j = tl.arange(0, CHUNK)[None, :]
    keep = (j <= i) if INCLUSIVE else (j < i)
    return tl.where(keep, tl.exp(tl.where(keep, cum_g[:, None] - cum_g[None, :], 0.0)), 0.0)


@triton.jit
def _inverse_kernel(
    k_ptr, g_ptr, beta_ptr, inverse_ptr, cu_seqlens_ptr,
    stride_k_t, stride_k_h, stride_g_t, stride_beta_t, dim_k, num_heads,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, DOT: tl.constexpr, ENTER: tl.constexpr,
):  # fmt: skip
    """``(I + A)^-1`` of one chunk of one head, into rows ``start:start + CHUNK`` of
    ``inverse`` [T, H, CHUNK], by forward substitution: row i of the inverse is
    ``e_i - sum_{j<i} A_ij row_j``."""
    ENTER()
    seq, chunk, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lo, hi = tl.load(cu_seqlens_ptr + seq).to(tl.int64), tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    start = lo + chunk * CHUNK
    if start >= hi:
        return
    k, cum_g, beta = _chunk_rows(k_ptr, g_ptr, beta_ptr, start, hi, head // GROUP, head, stride_k_t, stride_k_h,
                                 stride_g_t, stride_beta_t, dim_k, BLOCK_K, CHUNK)  # fmt: skip
    gram = tl.dot(k, tl.trans(k), input_precision=DOT)  # symmetric: [j, i] is k_i . k_j
    a_transposed = gram * (beta[None, :] * tl.trans(_decays(cum_g, CHUNK, False)))  # [j, i] = A_ij
    rows = tl.arange(0, CHUNK)
    inverse = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    for i in range(1, tl.minimum(hi - start, CHUNK)):  # rows past the end stay e_i
        a_i = tl.sum(tl.where(rows[None, :] == i, a_transposed, 0.0), axis=1)  # [j]: A_ij
        inverse -= tl.where(rows[:, None] == i, tl.sum(a_i[:, None] * inverse, axis=0)[None, :], 0.0)
    tl.store(inverse_ptr + ((start + rows) * num_heads + head)[:, None] * CHUNK + rows[None, :], inverse,
             mask=(start + rows < hi)[:, None])  # fmt: skip


@triton.jit
def _chunk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, inverse_ptr, state_ptr, out_ptr, cu_seqlens_ptr, seq_lens_ptr, slots_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h, stride_g_t, stride_beta_t,
    stride_o_t, stride_o_h, stride_s_slot, stride_s_h, stride_s_k, dim_k, dim_v, num_heads, scale,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK: tl.constexpr, DOT: tl.constexpr,
    ENTER: tl.constexpr,
):  # fmt: skip
    ENTER()
    seq, head = tl.program_id(0), tl.program_id(1)
    lo, hi = tl.load(cu_seqlens_ptr + seq).to(tl.int64), tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64)
    if hi == lo:
        return
    continues = tl.load(seq_lens_ptr + seq) != hi - lo
    k_head = head // GROUP
    ks = tl.arange(0, BLOCK_K)
    v_first = tl.program_id(2) * BLOCK_V
    vs = v_first + tl.arange(0, BLOCK_V)
    k_mask, v_mask = ks < dim_k, vs < dim_v
    state_ptrs = (state_ptr + tl.load(slots_ptr + seq).to(tl.int64) * stride_s_slot + head * stride_s_h
                  + ks[:, None] * stride_s_k + vs[None, :])  # fmt: skip
    tile_mask = k_mask[:, None] & v_mask[None, :]
    read_mask = (ks < tl.where(continues, dim_k, 0))[:, None] & v_mask[None, :]  # nothing unless it continues
    s = tl.load(state_ptrs, mask=read_mask, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    offsets = tl.arange(0, CHUNK)
    dtype = v_ptr.dtype.element_ty
    for start in range(lo, hi, CHUNK):
        rows = start + offsets
        in_seq = rows < hi
        k, cum_g, beta = _chunk_rows(k_ptr, g_ptr, beta_ptr, start, hi, k_head, head, stride_k_t, stride_k_h,
                                     stride_g_t, stride_beta_t, dim_k, BLOCK_K, CHUNK)  # fmt: skip
        q = _l2_normalized(_load_rows(q_ptr + k_head * stride_q_h, start, hi, stride_q_t, dim_k, CHUNK, BLOCK_K))
        q *= scale
        v = _load_rows(v_ptr + head * stride_v_h + v_first, start, hi, stride_v_t, dim_v - v_first, CHUNK, BLOCK_V)
        inverse = _load_rows(inverse_ptr + head * CHUNK, start, hi, num_heads * CHUNK, CHUNK, CHUNK, CHUNK)
        decay = tl.exp(cum_g)
        # the products' operands in the inputs' dtype (fp32 sums), as flash-linear-attention's
        k_in, q_in, s_in = k.to(dtype), q.to(dtype), s.to(dtype)
        r = beta[:, None] * (v - decay[:, None] * tl.dot(k_in, s_in, input_precision=DOT))
        d = tl.dot(inverse.to(dtype), r.to(dtype), input_precision=DOT).to(dtype)  # the rows' corrections
        scores = tl.dot(q_in, tl.trans(k_in), input_precision=DOT) * _decays(cum_g, CHUNK, True)
        o = decay[:, None] * tl.dot(q_in, s_in, input_precision=DOT) + tl.dot(scores.to(dtype), d, input_precision=DOT)
        tl.store(out_ptr + rows[:, None] * stride_o_t + head * stride_o_h + vs[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=in_seq[:, None] & v_mask[None, :])  # fmt: skip
        last = tl.sum(tl.where(offsets == CHUNK - 1, cum_g, 0.0), axis=0)  # G past the end: no decay there
        decayed_k = (k * tl.exp(last - cum_g)[:, None]).to(dtype)
        s = tl.exp(last) * s + tl.dot(tl.trans(decayed_k), d, input_precision=DOT)
    tl.store(state_ptrs, s.to(state_ptr.dtype.element_ty), mask=tile_mask)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    state: Tensor,
    meta: AttentionMetadata,
    slots: Tensor,
) -> Tensor:
    """See :func:`xinfer_qwen.deltanet_ops.gated_delta_rule`; rows of no sequence (a padded
    step's) are left unwritten. ``a`` and ``b`` [T, Hv] may be views with a row stride (columns
    of the layer's projection)."""
    out = torch.empty_like(v)
    if v.shape[0] == 0 or meta.num_seqs == 0:
        return out
    if meta.max_seqlen_q > 1:
        return delta_rule(q, k, v, *gates(a, b, A_log, dt_bias), state, meta, slots, out)
    _recurrent(q, k, v, a, b, A_log, dt_bias, state, meta, slots, out)
    return out


def gated_delta_rule_norm(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                          state: Tensor, meta: AttentionMetadata, slots: Tensor, z: Tensor, norm_weight: Tensor,
                          eps: float) -> Tensor:  # fmt: skip
    """See :func:`xinfer_qwen.deltanet_ops.gated_delta_rule_norm`. A decode step in one launch: the
    last of a head's Dv tiles to finish normalizes the head (at batch 1 the norm's own launch costs
    more than its work); a step with prompts through the rule's kernels, then the norm's."""
    counters = None
    if meta.max_seqlen_q <= 1 and v.shape[0] and meta.num_seqs:
        counters = helpers().counters(v.device, "gated_delta_rule_norm", meta.num_seqs * v.shape[1])
    if counters is None:
        return gated_rms_norm(gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, meta, slots), z, norm_weight, eps)
    out, normed = torch.empty_like(v), torch.empty(v.shape[0], v.shape[1] * v.shape[2], dtype=v.dtype, device=v.device)
    _recurrent(q, k, v, a, b, A_log, dt_bias, state, meta, slots, out, (z, norm_weight, eps, normed, counters))
    return normed


def _recurrent(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, state: Tensor,
               meta: AttentionMetadata, slots: Tensor, out: Tensor,
               norm: tuple[Tensor, Tensor, float, Tensor, Tensor] | None = None) -> None:  # fmt: skip
    """The recurrent kernel over a decode step's rows into ``out``; with ``norm`` = (z, its weight,
    eps, normed, counters) the gated RMSNorm of each head into ``normed``."""
    assert state.stride(-1) == 1, "gated_delta_rule: the state's rows must be contiguous"
    v_heads, dim_v = v.shape[1:]
    dim_k = k.shape[-1]
    z, norm_weight, eps, normed, counters = norm if norm is not None else (v, A_log, 0.0, out, slots)  # (unused)
    q, k, v, a, b, z = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, a, b, z))
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], a.stride(0), b.stride(0), *out.stride()[:2],
               *state.stride()[:3])  # fmt: skip
    grid = (meta.num_seqs, v_heads, triton.cdiv(dim_v, RECURRENT_BLOCK_V))
    _recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, state, out, meta.cu_seqlens_q, meta.seq_lens, slots, *strides, dim_k, dim_v,
        dim_k**-0.5, z, norm_weight, normed, counters, *z.stride()[:2], eps, GROUP=v_heads // k.shape[1],
        BLOCK_K=triton.next_power_of_2(dim_k), BLOCK_V=RECURRENT_BLOCK_V, NORM=norm is not None,
        BLOCK_DV=triton.next_power_of_2(dim_v), LAST_TO_ARRIVE=helpers().last_to_arrive, num_warps=4,
        **launch_chain(v.device),
    )  # fmt: skip


def gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """See :func:`xinfer_qwen.deltanet_ops.gates`: ``g``, ``beta`` [T, Hv] (fp32) in one launch."""
    a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (a, b))
    tokens, heads = a.shape
    g = torch.empty(tokens, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if tokens:
        block_t = 16
        _gates_kernel[(triton.cdiv(tokens, block_t),)](
            a, b, A_log, dt_bias, g, beta, tokens, heads, a.stride(0), b.stride(0), BLOCK_T=block_t,
            BLOCK_H=triton.next_power_of_2(heads), **launch_chain(a.device),
        )  # fmt: skip
    return g, beta


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    meta: AttentionMetadata,
    slots: Tensor,
    out: Tensor | None = None,
) -> Tensor:
    """See :func:`xinfer_qwen.deltanet_ops.delta_rule`: the chunked form (or fla's), for steps
    with prompts, into ``out`` (rows of no sequence left unwritten)."""
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    assert state.stride(-1) == 1, "delta_rule: the state's rows must be contiguous"
    tokens, v_heads, dim_v = v.shape
    dim_k = k.shape[-1]
    out = torch.empty_like(v) if out is None else out
    if tokens == 0 or meta.num_seqs == 0:
        return out
    if fla_prefill.wins(v.device, v.dtype, tokens, meta.num_seqs, meta.max_seqlen_q):
        return fla_prefill.delta_rule(q, k, v, g, beta, state, meta, slots)
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], g.stride(0), beta.stride(0), *out.stride()[:2],
               *state.stride()[:3])  # fmt: skip
    common = dict(GROUP=v_heads // k.shape[1], BLOCK_K=triton.next_power_of_2(dim_k), **launch_chain(v.device))
    # fp32 inputs: exact fp32 products (the tf32x3 tensor-core split gave the mixed-batch test's outputs at 0.9
    # relative error on an H200, Triton 3.6, where the interpreter's exact dots passed); 16-bit inputs: tf32 for
    # the fp32 normalized keys' Gram matrix, the operands' own precision elsewhere
    precision = "ieee" if v.dtype == torch.float32 else "tf32"
    inverse = torch.empty(tokens, v_heads, CHUNK, dtype=torch.float32, device=v.device)
    _inverse_kernel[(meta.num_seqs, triton.cdiv(meta.max_seqlen_q, CHUNK), v_heads)](
        k, g, beta, inverse, meta.cu_seqlens_q, *k.stride()[:2], g.stride(0), beta.stride(0), dim_k, v_heads,
        CHUNK=CHUNK, DOT=precision, num_warps=4, **common,
    )  # fmt: skip
    _chunk_kernel[(meta.num_seqs, v_heads, triton.cdiv(dim_v, CHUNK_BLOCK_V))](
        q, k, v, g, beta, inverse, state, out, meta.cu_seqlens_q, meta.seq_lens, slots, *strides, dim_k, dim_v,
        v_heads, dim_k**-0.5, BLOCK_V=CHUNK_BLOCK_V, CHUNK=CHUNK, DOT=precision, num_warps=8, num_stages=1, **common,
    )  # fmt: skip
    return out
