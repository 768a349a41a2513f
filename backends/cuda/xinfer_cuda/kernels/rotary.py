"""Rotary position embedding in rotate-half (NeoX) form, over the first R dims of each
head; optionally each head's RMSNorm before it (q/k norms), in the same pass; optionally
the rotated keys and the values stored straight into a paged cache of the model's kind
(:func:`rotary_write_kv`), where a separate write launch would read them back."""

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
    stride_k_out_slot,
    stride_k_out_head,
    stride_cos_sin,
    num_q_heads,
    num_k_heads,
    eps,
    v_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_v_tok,
    stride_v_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    HALF: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    NORM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    k_dst = k_out_ptr + tok * stride_k_out_tok
    if WRITE_KV:  # k_out is the key cache: the token's slot (a negative one, padding, stores no key)
        slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
        k_dst = k_out_ptr + (slot // BLOCK_SIZE) * stride_k_out_tok + (slot % BLOCK_SIZE) * stride_k_out_slot
        num_k_heads = tl.where(slot >= 0, num_k_heads, 0)
        heads = tl.arange(0, BLOCK_HK)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_k_heads) & (dims < HEAD_DIM)
        v = tl.load(v_ptr + tok * stride_v_tok + heads * stride_v_head + dims, mask=mask)
        v_dst = v_cache_ptr + (slot // BLOCK_SIZE) * stride_vc_block + (slot % BLOCK_SIZE) * stride_vc_slot
        tl.store(v_dst + heads * stride_vc_head + dims, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
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
        k_ptr + tok * stride_k_tok, k_dst, k_weight_ptr,
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
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    _launch(q, k, positions, cos_sin, norms, q_out, k_out, (k_out.stride(0), 0, k_out.stride(1)), None)
    return q_out, k_out


def rotary_write_kv(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    norms: HeadNorms | None,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
) -> Tensor:
    """:func:`rotary` of ``q`` and ``k`` whose keys go straight into ``k_cache`` (and ``v``
    [T, Hkv, D] into ``v_cache``), both [num_blocks, block_size, Hkv, D], at ``slot_mapping``
    [T] as :func:`~xinfer_cuda.kernels.kv_write.write_kv` stores them (negative: skipped).
    Returns the rotated queries."""
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    v = _unit_last_stride(v)
    writes = (v, v_cache, slot_mapping, v.stride(0), v.stride(1), *v_cache.stride()[:3])
    _launch(q, k, positions, cos_sin, norms, q_out, k_cache, k_cache.stride()[:3], writes)
    return q_out


def _launch(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    cos_sin: Tensor,
    norms: HeadNorms | None,
    q_out: Tensor,
    k_out: Tensor,
    k_out_strides: tuple[int, ...],
    writes: tuple | None,
) -> None:
    """The rotary kernel: keys into ``k_out`` at (token, 0, head) strides ``k_out_strides``,
    or with ``writes`` (v, its cache, the slots and their strides) at (block, slot, head)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    rot_dim = cos_sin.shape[-1]
    assert rot_dim % 2 == 0 and rot_dim <= head_dim, (rot_dim, head_dim)
    if num_tokens == 0:
        return
    q, k = _unit_last_stride(q), _unit_last_stride(k)
    cos_sin = _unit_last_stride(cos_sin)
    weights = (norms.q_weight.contiguous(), norms.k_weight.contiguous()) if norms else (q, k)  # (q, k): unused
    half = rot_dim // 2
    block_elems = triton.next_power_of_2(num_q_heads) * triton.next_power_of_2(half)
    unused = (q, q, positions, 0, 0, 0, 0, 0)  # (no cache: q and positions stand in)
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, *weights, positions, cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), *k_out_strides,
        cos_sin.stride(0), num_q_heads, num_k_heads, norms.eps if norms else 0.0,
        *(writes if writes is not None else unused),
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - rot_dim, 1)),
        NORM=norms is not None,
        WRITE_KV=writes is not None,
        BLOCK_SIZE=k_out.shape[1] if writes is not None else 1,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=min(max(block_elems // 512, 1), 8),
        **launch.pdl(q.device),
    )  # fmt: skip
