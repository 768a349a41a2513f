"""Store this step's K and V into a quantized paged cache in one launch: each program
takes BLOCK_T tokens of one KV head and one side (K or V), equalizes and rotates them
where the format does, encodes them (scale, codes, packing) and writes them in place.
Where the format rotates keys, a program per (BLOCK_T tokens, query head) brings the
step's queries into the keys' basis in the same launch, so attention reads them ready
instead of rotating them in every program that shares a query (each split of a long
decode)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.basis import signed_basis
from xinfer_cuda.kernels.kv_codes import CODE_FP8, encode, side, vector_scale
from xinfer_cuda.kernels.launch import pdl_entry


@triton.jit
def _pack4(codes, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Codes [ROWS, D] -> bytes [ROWS, D/2]: byte j holds dims j and D/2 + j."""
    lo, hi = tl.split(tl.permute(tl.reshape(codes, [ROWS, 2, HEAD_DIM // 2]), (0, 2, 1)))
    return lo | hi << 4


@triton.jit
def _pack3(codes, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Codes [ROWS, D] -> the planes of :func:`xinfer.kv.codes.pack3`: [ROWS, D/4] bytes
    of low bit pairs (dim i + q D/4 at bit 2q) and [ROWS, D/8] bytes of high bits (dim
    i + k D/8 at bit k). Each split takes the last axis, the lowest bit of q or k."""
    quarters = tl.reshape(
        tl.permute(tl.reshape(codes & 3, [ROWS, 4, HEAD_DIM // 4]), (0, 2, 1)), [ROWS, HEAD_DIM // 4, 2, 2]
    )
    lo, hi = tl.split(quarters)
    lo, hi = tl.split(lo | hi << 2)
    low = lo | hi << 4
    eighths = tl.permute(tl.reshape(codes >> 2, [ROWS, 8, HEAD_DIM // 8]), (0, 2, 1))
    lo, hi = tl.split(tl.reshape(eighths, [ROWS, HEAD_DIM // 8, 2, 2, 2]))
    lo, hi = tl.split(lo | hi << 1)
    lo, hi = tl.split(lo | hi << 2)
    return low, lo | hi << 4


@triton.jit
def _write_side(
    src,
    data_dst,
    scale_dst,
    rows,
    levels_ptr,
    basis_ptr,
    offset_row,
    equalizer_row,
    shadow_dst,
    shadow_rows,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHADOW: tl.constexpr,
    ROTATE: tl.constexpr,
    OFFSET: tl.constexpr,
    EQUALIZE: tl.constexpr,
    CODE: tl.constexpr,
    BITS: tl.constexpr,
    LEVELS: tl.constexpr,
    RMS_CLIP: tl.constexpr,
):
    """One side of BLOCK_T tokens: ``src``, ``data_dst``, ``scale_dst`` point at each
    token's row of this head; only ``rows`` are written. Each step rounds to the model
    dtype where the reference does: ``k - offset``, then ``/ equalizer``. With
    ``SHADOW``, the ``shadow_rows`` are also stored exact (transformed, not encoded) at
    ``shadow_dst``."""
    dims = tl.arange(0, HEAD_DIM)
    read = rows | shadow_rows if SHADOW else rows
    if ROTATE:
        # x @ basis / sqrt(D) over chunks of the input dim, so that a chunk of the basis,
        # not all of it, is on chip at a time. Its ±1 entries times values in the model
        # dtype are exact, so a tensor-core dot summing in fp32 matches the fp32 reference.
        x = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
        for start in tl.range(0, HEAD_DIM, BLOCK_K):
            chunk = start + tl.arange(0, BLOCK_K)
            part = tl.load(src[:, None] + chunk[None, :], mask=read[:, None], other=0.0)
            if OFFSET:
                c = tl.load(offset_row + chunk).to(part.dtype).to(tl.float32)
                part = (part.to(tl.float32) - c[None, :]).to(part.dtype)
            if EQUALIZE:
                s = tl.load(equalizer_row + chunk).to(part.dtype).to(tl.float32)
                part = (part.to(tl.float32) / s[None, :]).to(part.dtype)
            basis = tl.load(basis_ptr + chunk[:, None] * HEAD_DIM + dims[None, :]).to(part.dtype)
            x = tl.dot(part, basis, acc=x, input_precision="ieee")
        x = x * (1.0 / HEAD_DIM**0.5)
    else:
        x = tl.load(src[:, None] + dims[None, :], mask=read[:, None], other=0.0)
        if OFFSET:
            c = tl.load(offset_row + dims).to(x.dtype).to(tl.float32)
            x = (x.to(tl.float32) - c[None, :]).to(x.dtype)
        x = x.to(tl.float32)
    if SHADOW:  # a recent window's exact copy: the transformed row, in the model dtype
        tl.store(shadow_dst[:, None] + dims[None, :], x.to(shadow_dst.dtype.element_ty), mask=shadow_rows[:, None])
    scale = vector_scale(x, HEAD_DIM, RMS_CLIP)
    tl.store(scale_dst, scale, mask=rows)
    codes = encode(x, scale, levels_ptr, CODE, LEVELS)
    if CODE == CODE_FP8 or BITS == 8:
        tl.store(data_dst[:, None] + dims[None, :], codes.to(tl.uint8), mask=rows[:, None])
    elif BITS == 4:
        halves = tl.arange(0, HEAD_DIM // 2)
        tl.store(data_dst[:, None] + halves[None, :], _pack4(codes, BLOCK_T, HEAD_DIM).to(tl.uint8), mask=rows[:, None])
    else:
        low, high = _pack3(codes, BLOCK_T, HEAD_DIM)
        quarters = tl.arange(0, HEAD_DIM // 4)
        eighths = tl.arange(0, HEAD_DIM // 8)
        tl.store(data_dst[:, None] + quarters[None, :], low.to(tl.uint8), mask=rows[:, None])
        tl.store(data_dst[:, None] + HEAD_DIM // 4 + eighths[None, :], high.to(tl.uint8), mask=rows[:, None])


@triton.jit
def _rotate_query_head(
    src,
    dst,
    tokens_ok,
    basis_ptr,
    equalizer_row,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EQUALIZE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One query head of BLOCK_T tokens (``src``, ``dst`` point at each token's row) in
    the keys' basis, ``(q · e) @ signs / sqrt(D)`` summed in fp32, stored in ``dst``'s
    dtype."""
    dims = tl.arange(0, HEAD_DIM)
    x = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    for start in tl.range(0, HEAD_DIM, BLOCK_K):
        chunk = start + tl.arange(0, BLOCK_K)
        part = tl.load(src[:, None] + chunk[None, :], mask=tokens_ok[:, None], other=0.0).to(tl.float32)
        if EQUALIZE:
            part *= tl.load(equalizer_row + chunk).to(tl.float32)[None, :]
        basis = tl.load(basis_ptr + chunk[:, None] * HEAD_DIM + dims[None, :]).to(tl.float32)
        x = tl.dot(part, basis, acc=x, input_precision=PRECISION)
    x = x * (1.0 / HEAD_DIM**0.5)
    tl.store(dst[:, None] + dims[None, :], x.to(dst.dtype.element_ty), mask=tokens_ok[:, None])


@triton.jit
def _rotate_queries_kernel(
    q_ptr,
    q_out_ptr,
    basis_ptr,
    equalizer_ptr,
    num_tokens,
    stride_q_tok,
    stride_q_head,
    stride_qo_tok,
    stride_qo_head,
    stride_eq_head,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EQUALIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    head = tl.program_id(1)
    _rotate_query_head(
        q_ptr + tokens * stride_q_tok + head * stride_q_head, q_out_ptr + tokens * stride_qo_tok + head * stride_qo_head,
        tokens < num_tokens, basis_ptr, equalizer_ptr + head // GROUP * stride_eq_head,
        BLOCK_T, HEAD_DIM, BLOCK_K, EQUALIZE, PRECISION,
    )  # fmt: skip


@triton.jit
def _quant_write_kv_kernel(
    k_ptr,
    v_ptr,
    slot_mapping_ptr,
    basis_ptr,
    offset_ptr,
    equalizer_ptr,
    k_data_ptr,
    k_scale_ptr,
    k_levels_ptr,
    v_data_ptr,
    v_scale_ptr,
    v_levels_ptr,
    q_ptr,
    q_out_ptr,
    shadow_slot_ptr,
    k_shadow_ptr,
    v_shadow_ptr,
    num_tokens,
    stride_q_tok,
    stride_q_head,
    stride_qo_tok,
    stride_qo_head,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_off_head,
    stride_eq_head,
    stride_kd_block,
    stride_kd_slot,
    stride_kd_head,
    stride_ks_block,
    stride_ks_slot,
    stride_ks_head,
    stride_vd_block,
    stride_vd_slot,
    stride_vd_head,
    stride_vs_block,
    stride_vs_slot,
    stride_vs_head,
    stride_sh_block,
    stride_sh_slot,
    stride_sh_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SHADOW: tl.constexpr,
    OFFSET: tl.constexpr,
    EQUALIZE: tl.constexpr,
    K_ROTATE: tl.constexpr,
    K_CODE: tl.constexpr,
    K_BITS: tl.constexpr,
    K_LEVELS: tl.constexpr,
    K_CLIP: tl.constexpr,
    V_ROTATE: tl.constexpr,
    V_CODE: tl.constexpr,
    V_BITS: tl.constexpr,
    V_LEVELS: tl.constexpr,
    V_CLIP: tl.constexpr,
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    if tl.program_id(2) >= 2:  # a query head of this KV head's group, every token's
        q_head = head * GROUP + tl.program_id(2) - 2
        q_rows = tokens.to(tl.int64)
        _rotate_query_head(
            q_ptr + q_rows * stride_q_tok + q_head * stride_q_head, q_out_ptr + q_rows * stride_qo_tok + q_head * stride_qo_head,
            tokens < num_tokens, basis_ptr, equalizer_ptr + head * stride_eq_head,
            BLOCK_T, HEAD_DIM, BLOCK_K, EQUALIZE, PRECISION,
        )  # fmt: skip
        return
    slot = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    rows = slot >= 0  # in range and not padding
    slot = tl.maximum(slot, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    shadow_rows = rows
    shadow_at = 0
    if SHADOW:  # K and V shadows share a layout
        shadow = tl.load(shadow_slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
        shadow_rows = shadow >= 0
        shadow = tl.maximum(shadow, 0)
        shadow_at = (
            shadow // BLOCK_SIZE * stride_sh_block + shadow % BLOCK_SIZE * stride_sh_slot + head * stride_sh_head
        )
    tokens = tokens.to(tl.int64)
    if tl.program_id(2) == 0:  # K and V in programs of their own: twice the parallelism
        _write_side(
            k_ptr + tokens * stride_k_tok + head * stride_k_head,
            k_data_ptr + block * stride_kd_block + offset * stride_kd_slot + head * stride_kd_head,
            k_scale_ptr + block * stride_ks_block + offset * stride_ks_slot + head * stride_ks_head,
            rows, k_levels_ptr, basis_ptr, offset_ptr + head * stride_off_head, equalizer_ptr + head * stride_eq_head,
            k_shadow_ptr + shadow_at, shadow_rows,
            BLOCK_T, HEAD_DIM, BLOCK_K, SHADOW, K_ROTATE, OFFSET, EQUALIZE, K_CODE, K_BITS, K_LEVELS, K_CLIP,
        )  # fmt: skip
    else:
        _write_side(
            v_ptr + tokens * stride_v_tok + head * stride_v_head,
            v_data_ptr + block * stride_vd_block + offset * stride_vd_slot + head * stride_vd_head,
            v_scale_ptr + block * stride_vs_block + offset * stride_vs_slot + head * stride_vs_head,
            rows, v_levels_ptr, basis_ptr, offset_ptr, equalizer_ptr,
            v_shadow_ptr + shadow_at, shadow_rows,
            BLOCK_T, HEAD_DIM, BLOCK_K, SHADOW, V_ROTATE, False, False, V_CODE, V_BITS, V_LEVELS, V_CLIP,
        )  # fmt: skip


def quant_write_kv(
    k: Tensor,
    v: Tensor,
    cache: LayerKVCache,
    slot_mapping: Tensor,
    q: Tensor | None = None,
    shadow_slots: Tensor | None = None,
) -> Tensor | None:
    """Encode ``k``, ``v`` [T, Hkv, D] into ``cache`` at ``slot_mapping`` [T] (negative:
    skipped) as ``cache.format.quantize(k, v, cache.dtype, cache.equalizer,
    cache.key_offset)`` does: keys less the offset, rotated keys divided by the
    equalizer, then :func:`hadamard.rotate` where the format rotates. One launch does it all: at batch 1 a launch costs about as much as its work,
    and the equalizer, two rotation GEMMs and two encodes took five per layer.

    Given the step's queries ``q`` [T, H, D] and a format that rotates keys, the same
    launch also returns them in the keys' basis, ``cache.format.prepare_query(q,
    cache.equalizer)``, in the dtype the attention kernels score quantized keys in
    (fp16; fp32 for fp32 queries); else None.

    Given ``shadow_slots`` [T] (negative: none) of a cache with shadow blocks, the same
    launch also does what :func:`write_shadow_kv` does: one launch where a recent
    window took two per layer."""
    fmt = cache.format
    q = q if fmt.rotate_keys else None
    shadow_slots = shadow_slots if cache.shadows is not None else None
    k_side, v_side = side(cache, "k", fmt.key), side(cache, "v", fmt.value)
    rotate_keys, rotate_values, equalizer = fmt.rotate_keys, fmt.rotate_values, cache.equalizer
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return None if q is None else torch.empty(q.shape, dtype=_rotated_query_dtype(q), device=q.device)
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    assert k_side.data.stride(-1) == 1 and v_side.data.stride(-1) == 1
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, head_dim
    equalize = rotate_keys and equalizer is not None
    offset = cache.key_offset
    # k stands in for the tensors a launch does not read.
    basis = signed_basis(head_dim, k.device) if rotate_keys or rotate_values else k
    equalizer = equalizer.contiguous() if equalize else k
    key_offset = offset.contiguous() if offset is not None else k
    kd, ks, vd, vs = k_side.data, k_side.scale_or_data(), v_side.data, v_side.scale_or_data()
    # 16 rows fill the smallest tensor-core tile; a long prompt's programs take 64, each
    # loading the basis once (on an H200 about 2x faster at 4096 tokens, slower at 128).
    block_t = 16 if num_tokens <= 256 else 64
    # Programs per (tokens, KV head): K, V, then one per query head of its group.
    group = q.shape[1] // num_kv_heads if q is not None else 0
    if q is not None:
        q = q if q.stride(-1) == 1 else q.contiguous()
        q_out = torch.empty(q.shape, dtype=_rotated_query_dtype(q), device=q.device)
    q_in, q_out_arg = (q, q_out) if q is not None else (k, k)
    shadow = shadow_slots is not None
    if shadow:
        k_shadow, v_shadow = cache.shadows
        assert k_shadow.stride() == v_shadow.stride(), "K and V shadows must share a layout"
    else:  # (k and the slot mapping stand in)
        shadow_slots, k_shadow, v_shadow = slot_mapping, k, k
    _quant_write_kv_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads, 2 + group)](
        k, v, slot_mapping, basis, key_offset, equalizer,
        kd, ks, k_side.levels_or_data(), vd, vs, v_side.levels_or_data(), q_in, q_out_arg,
        shadow_slots, k_shadow, v_shadow,
        num_tokens,
        q_in.stride(0), q_in.stride(1), q_out_arg.stride(0), q_out_arg.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), key_offset.stride(0), equalizer.stride(0),
        kd.stride(0), kd.stride(1), kd.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        vd.stride(0), vd.stride(1), vd.stride(2), vs.stride(0), vs.stride(1), vs.stride(2), *k_shadow.stride()[:3],
        HEAD_DIM=head_dim, BLOCK_SIZE=kd.shape[1], BLOCK_T=block_t,
        BLOCK_K=_rotation_chunk(k), SHADOW=shadow,
        OFFSET=offset is not None, EQUALIZE=equalize,
        K_ROTATE=rotate_keys, K_CODE=k_side.code, K_BITS=k_side.bits, K_LEVELS=k_side.num_levels, K_CLIP=k_side.rms_clip,
        V_ROTATE=rotate_values, V_CODE=v_side.code, V_BITS=v_side.bits, V_LEVELS=v_side.num_levels, V_CLIP=v_side.rms_clip,
        GROUP=max(group, 1),
        PRECISION=_query_precision(k),
        num_warps=8, **launch.pdl(k.device),
    )  # fmt: skip
    return q_out if q is not None else None


def rotate_queries(q: Tensor, cache: LayerKVCache) -> Tensor:
    """``q`` [T, H, D] in the keys' basis of ``cache`` (a format that rotates keys), as
    :func:`quant_write_kv` returns it, in a launch of its own: for attention over a
    cache without storing a step first."""
    assert cache.format.rotate_keys, cache.format.name
    num_tokens, num_heads, head_dim = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(q.shape, dtype=_rotated_query_dtype(q), device=q.device)
    if num_tokens == 0:
        return out
    num_kv_heads = cache.num_kv_heads
    equalizer = cache.equalizer.contiguous() if cache.equalizer is not None else q
    _rotate_queries_kernel[(triton.cdiv(num_tokens, 16), num_heads)](
        q, out, signed_basis(head_dim, q.device), equalizer, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), equalizer.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_T=16, HEAD_DIM=head_dim, BLOCK_K=_rotation_chunk(q),
        EQUALIZE=cache.equalizer is not None, PRECISION=_query_precision(q),
        num_warps=4, **launch.pdl(q.device),
    )  # fmt: skip
    return out


def write_shadow_kv(k: Tensor, v: Tensor, cache: LayerKVCache, shadow_slots: Tensor) -> None:
    """Store ``k``, ``v`` exactly into ``cache.shadows`` at ``shadow_slots`` (negative:
    skipped): transformed as :func:`quant_write_kv` transforms them
    (``cache.format.stored_basis``), in the model dtype, not encoded. The write launch
    with no code rows; the attention op stores both in one launch instead."""
    no_codes = torch.full_like(shadow_slots, -1)
    quant_write_kv(k, v, cache, no_codes, shadow_slots=shadow_slots)


def _rotation_chunk(x: Tensor) -> int:
    """Input dims per rotation dot: fp32 dots run on the FMA units, in registers."""
    return min(x.shape[-1], 64 if x.element_size() < 4 else 16)


def _query_precision(x: Tensor) -> str:
    """The queries' rotation dots: tf32 for model-dtype queries (the scores they meet
    are fp16 dots), exact fp32 for fp32 ones."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _rotated_query_dtype(q: Tensor) -> torch.dtype:
    """fp16 for model-dtype queries (what the attention kernels score quantized keys
    in), fp32 for fp32 ones."""
    return torch.float32 if q.dtype == torch.float32 else torch.float16
