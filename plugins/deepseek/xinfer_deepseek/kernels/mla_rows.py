"""``mla_rows`` in Triton (:func:`xinfer_deepseek.mla_ops.mla_rows` is the reference): the step's
latent rows (stored into the latent cache too, where one is given) and rotated query rope parts in
one launch, and at small batches the absorbed queries in the same launch, where they would take a
copy, a rotary, a norm, a concatenation, a batched GEMM and the attention's store (six launches of a
few microseconds each at batch 1, for a few kilobytes and ``w_uk``).

The launch's first T programs take a token each: its latent normed and its rope key rotated (its
row), and every head's query rope part rotated. The other programs (at most
:data:`ABSORB_MAX_TOKENS` tokens) multiply every token's no-rope query part of one head by a column
chunk of that head's ``w_uk``, read once for all tokens; with more tokens a batched GEMM does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import launch_chain
from xinfer.ops import Rotation

ABSORB_MAX_TOKENS = 16
CHUNK_R = 128  # columns of w_uk per absorbing program


@triton.jit
def _store_row(row_ptr, latent, rope1, rope2, r, half, R: tl.constexpr, HALF: tl.constexpr):
    tl.store(row_ptr + r, latent.to(row_ptr.dtype.element_ty), mask=r < R)
    tl.store(row_ptr + R + half, rope1.to(row_ptr.dtype.element_ty), mask=half < HALF)
    tl.store(row_ptr + R + HALF + half, rope2.to(row_ptr.dtype.element_ty), mask=half < HALF)


@triton.jit
def _rows_kernel(
    q_ptr, kv_ptr, positions_ptr, cos_sin_ptr, norm_weight_ptr, w_uk_ptr, q_latent_ptr, q_rope_ptr, rows_ptr,
    cache_ptr, slot_mapping_ptr, num_tokens, num_heads, eps,
    stride_q_tok, stride_q_head, stride_kv_tok, stride_cos_sin, stride_w_head, stride_w_row,
    stride_ql_tok, stride_ql_head, stride_qr_tok, stride_qr_head, stride_rows_tok,
    N: tl.constexpr, R: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr, STORE: tl.constexpr,
    ENTER: tl.constexpr,
):  # fmt: skip
    ENTER()
    program = tl.program_id(0)
    if program < num_tokens:
        tok = program.to(tl.int64)
        pos = tl.load(positions_ptr + tok).to(tl.int64)
        half = tl.arange(0, BLOCK_HALF)
        half_ok = half < HALF
        cos = tl.load(cos_sin_ptr + pos * stride_cos_sin + half, mask=half_ok, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cos_sin + HALF + half, mask=half_ok, other=0.0).to(tl.float32)

        r = tl.arange(0, BLOCK_R)
        kv = kv_ptr + tok * stride_kv_tok
        latent = tl.load(kv + r, mask=r < R, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(latent * latent, 0) / R + eps)
        weight = tl.load(norm_weight_ptr + r, mask=r < R, other=0.0).to(tl.float32)
        normed = (latent * inv_rms * weight).to(rows_ptr.dtype.element_ty)
        k1 = tl.load(kv + R + half, mask=half_ok, other=0.0).to(tl.float32)
        k2 = tl.load(kv + R + HALF + half, mask=half_ok, other=0.0).to(tl.float32)
        k_rope1 = (k1 * cos - k2 * sin).to(rows_ptr.dtype.element_ty)
        k_rope2 = (k2 * cos + k1 * sin).to(rows_ptr.dtype.element_ty)
        _store_row(rows_ptr + tok * stride_rows_tok, normed, k_rope1, k_rope2, r, half, R, HALF)
        if STORE:
            slot = tl.load(slot_mapping_ptr + tok)
            if slot >= 0:  # (negative: padding)
                _store_row(cache_ptr + slot * (R + 2 * HALF), normed, k_rope1, k_rope2, r, half, R, HALF)

        heads = tl.arange(0, BLOCK_H)[:, None]
        ok = (heads < num_heads) & half_ok[None, :]
        src = q_ptr + tok * stride_q_tok + heads * stride_q_head + N + half[None, :]
        q1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
        q2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
        dst = q_rope_ptr + tok * stride_qr_tok + heads * stride_qr_head + half[None, :]
        tl.store(dst, (q1 * cos[None, :] - q2 * sin[None, :]).to(q_rope_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF, (q2 * cos[None, :] + q1 * sin[None, :]).to(q_rope_ptr.dtype.element_ty), mask=ok)
    else:  # q_latent[:, head, chunk] = q_nope[:, head] @ w_uk[head, :, chunk]
        chunks = tl.cdiv(R, CHUNK)
        head = (program - num_tokens) // chunks
        cols = (program - num_tokens) % chunks * CHUNK + tl.arange(0, CHUNK)
        n = tl.arange(0, BLOCK_N)
        w_ok = (n < N)[:, None] & (cols < R)[None, :]
        w = w_uk_ptr + head.to(tl.int64) * stride_w_head + n[:, None] * stride_w_row + cols[None, :]
        w = tl.load(w, mask=w_ok, other=0.0).to(tl.float32)  # [BLOCK_N, CHUNK]
        for token in range(num_tokens):
            src = q_ptr + token * stride_q_tok + head * stride_q_head + n
            q_nope = tl.load(src, mask=n < N, other=0.0).to(tl.float32)
            q_latent = tl.sum(q_nope[:, None] * w, 0)
            dst = q_latent_ptr + token * stride_ql_tok + head * stride_ql_head + cols
            tl.store(dst, q_latent.to(q_latent_ptr.dtype.element_ty), mask=cols < R)


def mla_rows(
    q: Tensor,
    kv: Tensor,
    rotation: Rotation,
    norm_weight: Tensor,
    eps: float,
    w_uk: Tensor,
    cache: Tensor | None = None,
    slot_mapping: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`xinfer_deepseek.mla_ops.mla_rows` in one launch (two past :data:`ABSORB_MAX_TOKENS` tokens),
    the rows stored into ``cache`` by the programs that make them."""
    num_tokens, num_heads, _ = q.shape
    nope, rank = w_uk.shape[1:]
    rope = q.shape[-1] - nope
    cos_sin = rotation.cos_sin
    assert rotation.norms is None and cos_sin.shape[-1] == rope == kv.shape[-1] - rank, (cos_sin.shape, q.shape)
    assert q.stride(-1) == kv.stride(-1) == cos_sin.stride(-1) == w_uk.stride(-1) == 1
    absorb = num_tokens <= ABSORB_MAX_TOKENS
    if absorb:
        q_latent = q.new_empty((num_tokens, num_heads, rank))
    else:
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)
    q_rope = q.new_empty((num_tokens, num_heads, rope))
    rows = kv.new_empty((num_tokens, rank + rope))
    if num_tokens == 0:
        return q_latent, q_rope, rows
    if cache is not None:
        assert slot_mapping is not None and cache.is_contiguous() and cache.shape[-1] == rank + rope, cache.shape
    chunk = min(CHUNK_R, triton.next_power_of_2(rank))
    grid = num_tokens + (num_heads * triton.cdiv(rank, chunk) if absorb else 0)
    _rows_kernel[(grid,)](
        q, kv, rotation.positions, cos_sin, norm_weight, w_uk, q_latent, q_rope, rows,
        rows if cache is None else cache, rotation.positions if slot_mapping is None else slot_mapping,
        num_tokens, num_heads, eps,
        q.stride(0), q.stride(1), kv.stride(0), cos_sin.stride(0), w_uk.stride(0), w_uk.stride(1),
        *q_latent.stride()[:2], *q_rope.stride()[:2], rows.stride(0),
        N=nope, R=rank, HALF=rope // 2, BLOCK_N=triton.next_power_of_2(nope), BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_HALF=triton.next_power_of_2(rope // 2), BLOCK_H=triton.next_power_of_2(num_heads), CHUNK=chunk,
        STORE=cache is not None, num_warps=8, **launch_chain(q.device),
    )  # fmt: skip
    return q_latent, q_rope, rows
