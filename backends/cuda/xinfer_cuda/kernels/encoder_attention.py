"""Non-causal attention within the segments of a flat batch (:meth:`xinfer.ops.Ops.encoder_attention`):
the patches of each image of a vision encoder's batch attend to each other, all images in one launch.

One program per (query tile, query head). The tiles of a segment start at
``cu_seqlens[b] // BLOCK_M + b`` (:func:`~xinfer_cuda.kernels.shared.tile_owner`), so the grid
depends only on the token and segment counts. Each program folds its segment's keys in tiles into an
online softmax (fp32, base 2). Queries, keys and values are read through their strides: the views of
a merged QKV projection need no copy. A head dim that is not a power of two is padded in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kernel_api import LOG2E
from xinfer_cuda.kernels.shared import NEG_BIG, tile_owner


@triton.jit
def _encoder_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_seqlens_ptr,
    num_seqs,
    score_scale,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_o_tok,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    seq = tile_owner(cu_seqlens_ptr, num_seqs, tile, BLOCK_M)
    start = tl.load(cu_seqlens_ptr + seq)
    end = tl.load(cu_seqlens_ptr + seq + 1)
    first = start + (tile - start // BLOCK_M - seq) * BLOCK_M
    if first >= end:  # the spare tile of a segment that fills its tiles
        return
    kv_head = head // GROUP
    rows = first + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < end
    dim_ok = dims < HEAD_DIM
    q_off = rows.to(tl.int64)[:, None] * stride_q_tok + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for key_start in range(start, end, BLOCK_N):
        keys = key_start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k_off = keys.to(tl.int64)[:, None] * stride_k_tok + kv_head * stride_k_head + dims[None, :]
        v_off = keys.to(tl.int64)[:, None] * stride_v_tok + kv_head * stride_v_head + dims[None, :]
        k = tl.load(k_ptr + k_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + v_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = rows.to(tl.int64)[:, None] * stride_o_tok + head * stride_o_head + dims[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


INTERPRETER_TILES = (16, 16, 4, 1)  # small tiles, so that small tests cross them
FMA_TILES = (32, 32, 4, 1)  # dots on the FMA units (fp32 in "ieee" precision, before sm_80): no spills
TENSOR_CORE_TILES = (
    128,
    32,
    8,
    2,
)  # sm_90 at head dim 72 (Qwen3-VL, SigLIP): 255 registers, no spill (64 keys: spills)


def _tiles(q: Tensor) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if q.device.type != "cuda":
        return INTERPRETER_TILES
    if q.dtype == torch.float32 or torch.cuda.get_device_capability(q.device)[0] < 8:
        return FMA_TILES
    return TENSOR_CORE_TILES


def encoder_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float, tiles: tuple[int, int, int, int] | None = None
) -> Tensor:
    """Rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` of ``q`` [T, H, D] attend to the same rows of ``k``,
    ``v`` [T, Hkv, D] (any strides with unit stride along D), every key visible; [T, H, D] in the
    dtype of ``q``. One launch for every segment. ``tiles`` overrides (BLOCK_M, BLOCK_N, warps, stages)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, block_n, num_warps, num_stages = tiles or _tiles(q)
    grid = (num_tokens // block_m + num_seqs, num_heads)
    _encoder_attention_kernel[grid](
        q, k, v, out, cu_seqlens, num_seqs, scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
