"""Store this step's K or V into a quantized paged cache: one program per token
encodes all of its KV heads (scale, codes, packing) and writes them in place."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels.kv_codes import CODE_FP8, Side, encode, vector_scale


@triton.jit
def _quant_write_kernel(
    x_ptr,
    data_ptr,
    scale_ptr,
    levels_ptr,
    slot_mapping_ptr,
    stride_x_tok,
    stride_x_head,
    stride_d_block,
    stride_d_slot,
    stride_d_head,
    stride_s_block,
    stride_s_slot,
    stride_s_head,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CODE: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_BYTES: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < num_kv_heads
    src = x_ptr + tok * stride_x_tok + heads[:, None] * stride_x_head
    dims = tl.arange(0, BLOCK_D)[None, :]
    x = tl.load(src + dims, mask=head_ok[:, None] & (dims < HEAD_DIM), other=0.0).to(tl.float32)
    scale = vector_scale(x, CODE, HEAD_DIM)
    s_dst = scale_ptr + block * stride_s_block + offset * stride_s_slot + heads * stride_s_head
    tl.store(s_dst, scale, mask=head_ok)
    dst = data_ptr + block * stride_d_block + offset * stride_d_slot + heads[:, None] * stride_d_head
    if CODE == CODE_FP8:
        codes = encode(x, scale, levels_ptr, CODE, LEVELS)
        tl.store(dst + dims, codes.to(tl.uint8), mask=head_ok[:, None] & (dims < HEAD_DIM))
    else:
        groups = tl.arange(0, BLOCK_D // GROUP)[None, :]
        group_mask = head_ok[:, None] & (groups < HEAD_DIM // GROUP)
        word = tl.zeros([BLOCK_H, BLOCK_D // GROUP], tl.int32)
        for j in tl.static_range(GROUP):
            xj = tl.load(src + groups * GROUP + j, mask=group_mask, other=0.0).to(tl.float32)
            word |= encode(xj, scale, levels_ptr, CODE, LEVELS) << (BITS * j)
        for b in tl.static_range(GROUP_BYTES):
            tl.store(dst + groups * GROUP_BYTES + b, ((word >> (8 * b)) & 0xFF).to(tl.uint8), mask=group_mask)


def quant_write(x: Tensor, side: Side, slot_mapping: Tensor) -> None:
    """Encode ``x`` [T, Hkv, D] into ``side`` at ``slot_mapping`` (negative: skipped)."""
    num_tokens, num_kv_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    data, scale = side.data, side.scale
    assert data.stride(-1) == 1 and scale is not None
    assert head_dim % side.group == 0 and head_dim & (head_dim - 1) == 0, head_dim
    block_h = triton.next_power_of_2(num_kv_heads)
    _quant_write_kernel[(num_tokens,)](
        x, data, scale, side.levels_or_data(), slot_mapping,
        x.stride(0), x.stride(1),
        data.stride(0), data.stride(1), data.stride(2),
        scale.stride(0), scale.stride(1), scale.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=data.shape[1], BLOCK_H=block_h, BLOCK_D=head_dim,
        CODE=side.code, BITS=side.bits, LEVELS=side.num_levels,
        GROUP=side.group, GROUP_BYTES=side.group_bytes,
        num_warps=min(max(block_h * head_dim // 512, 1), 8),
    )  # fmt: skip
