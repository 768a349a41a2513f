"""Rotary position embedding in rotate-half (NeoX) form, over the first R dims of each
head; optionally each head's RMSNorm before it (q/k norms), in the same pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.ops import HeadNorms
from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    weight_ptr,
    stride_src_head,
    stride_dst_head,
    num_heads,
    cos,
    sin,
    eps,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    NORM: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    half = tl.arange(0, BLOCK_HALF)[None, :]
    rest = 2 * HALF + tl.arange(0, BLOCK_PASS)[None, :]  # dims past the rotated ones
    mask = (heads < num_heads) & (half < HALF)
    rest_mask = (heads < num_heads) & (rest < HEAD_DIM)  # all false when R = D
    src = src_ptr + heads * stride_src_head
    dst = dst_ptr + heads * stride_dst_head
    x1 = tl.load(src + half, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + half, mask=mask, other=0.0)
    x_rest = tl.load(src + rest, mask=rest_mask, other=0.0)
    if NORM:
        x1, x2, x_rest = x1.to(tl.float32), x2.to(tl.float32), x_rest.to(tl.float32)
        squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(x_rest * x_rest, axis=1)
        inv_rms = tl.rsqrt(squares / HEAD_DIM + eps)[:, None]
        w1 = tl.load(weight_ptr + half, mask=half < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + half, mask=half < HALF, other=0.0).to(tl.float32)
        w_rest = tl.load(weight_ptr + rest, mask=rest < HEAD_DIM, other=0.0).to(tl.float32)
        # rounded to the input dtype, as a separate norm's output would be
        x1 = (x1 * inv_rms * w1).to(src_ptr.dtype.element_ty)
        x2 = (x2 * inv_rms * w2).to(src_ptr.dtype.element_ty)
        x_rest = (x_rest * inv_rms * w_rest).to(src_ptr.dtype.element_ty)
    y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
    y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
    tl.store(dst + half, y1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + half, y2.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + rest, x_rest.to(dst_ptr.dtype.element_ty), mask=rest_mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_weight_ptr,
    k_weight_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_q_out_tok,
    stride_q_out_head,
    stride_k_out_tok,
    stride_k_out_head,
    stride_cos_sin,
    num_q_heads,
    num_k_heads,
    eps,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    half = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + pos * stride_cos_sin + half
    cos = tl.load(row, mask=half < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF, mask=half < HALF, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + tok * stride_q_tok, q_out_ptr + tok * stride_q_out_tok, q_weight_ptr,
        stride_q_head, stride_q_out_head, num_q_heads, cos, sin, eps,
        HALF, HEAD_DIM, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS, NORM,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + tok * stride_k_tok, k_out_ptr + tok * stride_k_out_tok, k_weight_ptr,
        stride_k_head, stride_k_out_head, num_k_heads, cos, sin, eps,
        HALF, HEAD_DIM, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, NORM,
    )  # fmt: skip


def _unit_last_stride(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rotary(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    norms: HeadNorms | None = None,
    q_out: Tensor | None = None,
    k_out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Rotate the first ``R = cos_sin.shape[-1]`` dims of each head of ``q`` [T, H, D] and
    ``k`` [T, Hkv, D] by the angles of ``positions`` [T], after each head's RMSNorm where
    ``norms`` are given. Out of place: the inputs are left as they were."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, (rot_dim, head_dim)
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    if num_tokens == 0:
        return q_out, k_out
    cos_sin = _unit_last_stride(cos_sin)
    weights = (norms.q_weight.contiguous(), norms.k_weight.contiguous()) if norms else (q, k)  # (q, k): unused
    half = rot_dim // 2
    block_elems = triton.next_power_of_2(num_q_heads) * triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, *weights, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin.stride(0), num_q_heads, num_k_heads, norms.eps if norms else 0.0,
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - rot_dim, 1)),
        NORM=norms is not None,
        num_warps=min(max(block_elems // 512, 1), 8),
        **launch.pdl(q.device),
    )  # fmt: skip
    return q_out, k_out
