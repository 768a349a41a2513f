"""Multi-head latent attention over a paged latent cache: the CUDA backend's kernels of
``mla_attention`` and ``mla_attention_fp8`` (:mod:`xinfer_deepseek.mla_ops` holds the
references and the fp8 row layout).

Every head attends over the same cache rows (latent ``R`` || rope key ``P``), so MLA is
attention with one KV head of dimension ``R + P`` whose values are the rows' first ``R``
columns. The kernels read each tile of rows once for many heads: a tile's rows are
(query, head) pairs, its scores ``q_latent @ latentᵀ + q_rope @ ropeᵀ`` and its output
``p @ latent`` are two dots and one (fp32 accumulators, online softmax in base 2).

- ``_store_kernel`` writes the step's rows to their slots first (one program a token).
- ``_decode_kernel`` + ``_reduce_kernel`` for sequences with one query: one program per
  (head group, sequence, split of the context), flash-decoding; the reduce merges the
  partial (acc, max, sum) of the splits the context reaches (programs of the others
  return at once), one program per (sequence, head, chunk of columns). A layer's decode
  reads each context row, (R + P) x 2 bytes, once from memory (its head groups,
  neighbours in the grid, share it through L2): the point of MLA. In a decode step of
  a few tokens the reduce also up-projects each head's merged latent by ``w_uv`` (its
  chunk of the head's output), where a batched GEMM would be a launch of its own.
- ``_prefill_kernel`` for sequences with more queries (prefill, chunked prefill): one
  program per (tile of queries of the flat batch, head group), under the causal mask.

fp8 rows are encoded by torch ops before the store (no host syncs), which round alike on
every device (:func:`~xinfer_deepseek.mla_ops.encode_fp8`), so the kernels store the
reference's bytes; the attention kernels read a row's parts from their planes
(:class:`Planes`) and decode the e4m3 latents on their group scales in registers, into
the queries' dtype, so the dots are the same.

Grids depend only on tensor shapes and split lengths are computed from ``seq_lens`` in
the kernels, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer import kernel_api
from xinfer.kernel_api import LOG2E, decode_num_splits, helpers, launch_chain
from xinfer.kv.codes import FP8_MAX
from xinfer.ops import AttentionMetadata
from xinfer_deepseek.mla_ops import encode_fp8, expand, fp8_groups

NEG_BIG: tl.constexpr = tl.constexpr(kernel_api.NEG_BIG)
FP8_MAX_C: tl.constexpr = tl.constexpr(FP8_MAX)
DOT_MIN = 16  # tl.dot's smallest side: narrower rows and columns are padded (masked) to it


@triton.jit
def _store_kernel(rows_ptr, cache_ptr, slot_mapping_ptr, stride_tok, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr,
                  ENTER: tl.constexpr):  # fmt: skip
    ENTER()
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok)
    if slot < 0:  # padding
        return
    cols = tl.arange(0, BLOCK_W)
    row = tl.load(rows_ptr + tok * stride_tok + cols, mask=cols < WIDTH)
    tl.store(cache_ptr + slot * WIDTH + cols, row.to(cache_ptr.dtype.element_ty), mask=cols < WIDTH)


@triton.jit
def _load_rows(ptr, offsets, row_ok, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    """Rows of ``WIDTH`` elements at element ``offsets`` [M], as [M, BLOCK_W] (0 past the end)."""
    cols = tl.arange(0, BLOCK_W)
    return tl.load(ptr + offsets[:, None] + cols[None, :], mask=row_ok[:, None] & (cols < WIDTH)[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, offsets, row_ok, rows, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    cols = tl.arange(0, BLOCK_W)
    at = ptr + offsets[:, None] + cols[None, :]
    tl.store(at, rows.to(ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < WIDTH)[None, :])


@triton.jit
def _dequantize(codes, scales_ptr, rows_ok, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                GROUP: tl.constexpr, FP8_VALUE: tl.constexpr):  # fmt: skip
    """e4m3 codes [N, R] (R a multiple of GROUP) on their rows' fp32 group scales at
    ``scales_ptr`` [N]: code * absmax / 448, in ``DTYPE``."""
    groups = tl.arange(0, BLOCK_R // GROUP)
    scales = tl.load(scales_ptr[:, None] + groups[None, :], mask=rows_ok[:, None], other=0.0)
    scales = (scales * (256.0 / FP8_MAX_C)).to(DTYPE)  # (FP8_VALUE is e4m3 / 256)
    values = tl.reshape(FP8_VALUE(codes).to(DTYPE), (BLOCK_N, BLOCK_R // GROUP, GROUP))
    return tl.reshape(values * scales[:, :, None], (BLOCK_N, BLOCK_R))


@triton.jit
def _attend(acc, l_i, m_i, q_latent, q_rope, q_pos, start, end, latent_ptr, rope_ptr, scale_ptr, block_table_ptr,
            score_scale, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, R: tl.constexpr,
            P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
            LATENT_STRIDE: tl.constexpr, ROPE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr,
            PRECISION: tl.constexpr, FP8_VALUE: tl.constexpr):  # fmt: skip
    """Fold the cache rows at positions [start, end) into the running (acc, l_i, m_i) of
    the query rows; with ``CAUSAL`` a row at ``q_pos`` sees positions up to its own.
    A row's parts are read from their planes (:class:`Planes`); fp8 latents are decoded
    in registers into the queries' dtype."""
    for tile_start in range(start, end, BLOCK_N):
        k_pos = tile_start + tl.arange(0, BLOCK_N)
        in_range = k_pos < end
        block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + k_pos % BLOCK_SIZE
        latent = _load_rows(latent_ptr, slot * LATENT_STRIDE, in_range, R, BLOCK_R)
        if FP8:
            latent = _dequantize(latent, scale_ptr + slot * SCALE_STRIDE, in_range, q_latent.dtype, BLOCK_N, BLOCK_R,
                                 GROUP, FP8_VALUE)  # fmt: skip
        rope = _load_rows(rope_ptr, slot * ROPE_STRIDE, in_range, P, BLOCK_P).to(q_rope.dtype)
        s = tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
        s = tl.dot(q_rope, tl.trans(rope), s, input_precision=PRECISION) * score_scale
        visible = in_range[None, :]
        if CAUSAL:
            visible = visible & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        weights = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(weights, 1)
        acc = tl.dot(weights.to(latent.dtype), latent, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_latent_ptr, q_rope_ptr, latent_ptr, rope_ptr, scale_ptr, out_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    block_tables_ptr, num_seqs, num_heads, score_scale,
    stride_ql_tok, stride_ql_head, stride_qr_tok, stride_qr_head, stride_o_tok, stride_o_head, stride_bt,
    Q_PER_TILE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    R: tl.constexpr, P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FP8: tl.constexpr,
    GROUP: tl.constexpr, LATENT_STRIDE: tl.constexpr, ROPE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr,
    PRECISION: tl.constexpr, ENTER: tl.constexpr, TILE_OWNER: tl.constexpr, FP8_VALUE: tl.constexpr,
):  # fmt: skip
    ENTER()
    tile = tl.program_id(0)
    head_group = tl.program_id(1)
    seq = TILE_OWNER(cu_seqlens_q_ptr, num_seqs, tile, Q_PER_TILE)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    # each sequence's last query tiles first: under the causal mask they see the most rows
    first_q = (tl.cdiv(q_len, Q_PER_TILE) - 1 - (tile - q_start // Q_PER_TILE - seq)) * Q_PER_TILE
    if first_q < 0 or q_len == 1:  # one query: the decode kernel's
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tl.arange(0, Q_PER_TILE * BLOCK_H)
    q_idx = first_q + rows // BLOCK_H
    head = head_group * BLOCK_H + rows % BLOCK_H
    row_ok = (head < num_heads) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    q_latent = _load_rows(q_latent_ptr, tok * stride_ql_tok + head * stride_ql_head, row_ok, R, BLOCK_R)
    q_rope = _load_rows(q_rope_ptr, tok * stride_qr_tok + head * stride_qr_head, row_ok, P, BLOCK_P)
    q_pos = seq_len - q_len + q_idx
    last_pos = seq_len - q_len + tl.minimum(first_q + Q_PER_TILE, q_len) - 1

    m_i = tl.full([Q_PER_TILE * BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([Q_PER_TILE * BLOCK_H], tl.float32)
    acc = tl.zeros([Q_PER_TILE * BLOCK_H, BLOCK_R], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_latent, q_rope, q_pos, 0, last_pos + 1, latent_ptr, rope_ptr, scale_ptr,
                            block_table, score_scale, True, BLOCK_N, BLOCK_SIZE, R, P, BLOCK_R, BLOCK_P, FP8, GROUP,
                            LATENT_STRIDE, ROPE_STRIDE, SCALE_STRIDE, PRECISION, FP8_VALUE)  # fmt: skip
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    _store_rows(out_ptr, tok * stride_o_tok + head * stride_o_head, row_ok, out, R, BLOCK_R)


@triton.jit(do_not_specialize=["num_splits"])  # (one compile whatever the count)
def _decode_kernel(
    q_latent_ptr, q_rope_ptr, latent_ptr, rope_ptr, scale_ptr, out_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
    block_tables_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads, num_splits, score_scale,
    stride_ql_tok, stride_ql_head, stride_qr_tok, stride_qr_head, stride_o_tok, stride_o_head, stride_bt,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr,
    LATENT_STRIDE: tl.constexpr, ROPE_STRIDE: tl.constexpr, SCALE_STRIDE: tl.constexpr, PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr, ENTER: tl.constexpr, FP8_VALUE: tl.constexpr,
):  # fmt: skip
    ENTER()
    head_group = tl.program_id(0)  # fastest: every head group of a sequence's split together
    seq = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_len != 1:  # padding, or a prompt chunk: the prefill kernel's
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start >= end:  # a split past the context: the reduce reads only those it reaches
        return

    head = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = head < num_heads
    tok = q_start.to(tl.int64)
    q_latent = _load_rows(q_latent_ptr, tok * stride_ql_tok + head * stride_ql_head, row_ok, R, BLOCK_R)
    q_rope = _load_rows(q_rope_ptr, tok * stride_qr_tok + head * stride_qr_head, row_ok, P, BLOCK_P)
    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # (l_i stands in for the query positions, which only a causal mask reads)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q_latent, q_rope, l_i, start, end, latent_ptr, rope_ptr, scale_ptr,
                            block_table, score_scale, False, BLOCK_N, BLOCK_SIZE, R, P, BLOCK_R, BLOCK_P, FP8, GROUP,
                            LATENT_STRIDE, ROPE_STRIDE, SCALE_STRIDE, PRECISION, FP8_VALUE)  # fmt: skip
    if PARTIAL:
        part = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        _store_rows(part_acc_ptr, part * R, row_ok, acc, R, BLOCK_R)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        _store_rows(out_ptr, tok * stride_o_tok + head * stride_o_head, row_ok, out, R, BLOCK_R)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, cu_seqlens_q_ptr, seq_lens_ptr, w_uv_ptr, num_heads,
    num_splits, stride_o_tok, stride_o_head, stride_w_head, stride_w_row,
    BLOCK_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, CHUNK_R: tl.constexpr,
    EXPAND: tl.constexpr, V: tl.constexpr, CHUNK_V: tl.constexpr, ENTER: tl.constexpr,
):  # fmt: skip
    """Merges a (sequence, head)'s splits, those its context reaches, into its latent output's
    chunk ``program_id(2)``, or with ``EXPAND`` into that chunk of its output ``o_latent @ w_uvᵀ``."""
    ENTER()
    seq = tl.program_id(0)
    head = tl.program_id(1)
    chunk = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    if tl.load(cu_seqlens_q_ptr + seq + 1) - q_start != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, BLOCK_N)  # (the decode's)
    splits = tl.arange(0, BLOCK_SPLITS)
    active = splits < tl.cdiv(seq_len, split_len)  # (the decode kernel leaves the others unwritten)
    part = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    m = tl.load(part_max_ptr + part, mask=active, other=NEG_BIG)
    weight = tl.where(active, tl.exp2(m - tl.max(m, 0)), 0.0)
    total = tl.sum(weight * tl.load(part_sum_ptr + part, mask=active, other=0.0), 0)
    weight = weight / tl.where(total == 0.0, 1.0, total)
    out = out_ptr + q_start.to(tl.int64) * stride_o_tok + head * stride_o_head
    if EXPAND:
        v = chunk * CHUNK_V + tl.arange(0, CHUNK_V)
        w_uv = w_uv_ptr + head.to(tl.int64) * stride_w_head + v[:, None] * stride_w_row
        result = tl.zeros([CHUNK_V], tl.float32)
        for start in range(0, R, CHUNK_R):
            r = start + tl.arange(0, CHUNK_R)
            acc = tl.load(part_acc_ptr + part[:, None] * R + r[None, :], mask=active[:, None] & (r < R)[None, :],
                          other=0.0)  # fmt: skip
            o_latent = tl.sum(weight[:, None] * acc, 0).to(out_ptr.dtype.element_ty).to(tl.float32)  # (rounded once)
            w = tl.load(w_uv + r[None, :], mask=(v < V)[:, None] & (r < R)[None, :], other=0.0).to(tl.float32)
            result += tl.sum(w * o_latent[None, :], 1)
        tl.store(out + v, result, mask=v < V)
    else:
        r = chunk * CHUNK_R + tl.arange(0, CHUNK_R)
        acc = tl.load(part_acc_ptr + part[:, None] * R + r[None, :], mask=active[:, None] & (r < R)[None, :], other=0.0)
        tl.store(out + r, tl.sum(weight[:, None] * acc, 0), mask=r < R)


@dataclass(frozen=True)
class Tiles:
    block_m: int  # rows of a program: heads (decode), or (query, head) pairs (prefill)
    block_n: int  # cache rows per inner-loop step
    num_warps: int
    num_stages: int


# name: (decode, prefill). Chosen without a GPU at hand, by compile_check (bf16 queries, R 512, P 64,
# sm_90 and sm_80): bf16 rows decode in 192-203 registers, prefill in 178-186 with 8 warps (4 spilled
# 104 bytes); fp8 rows, decoded in registers, in 226-246 with 16-row tiles and 8 warps (32-row tiles
# spilled 16-3232 bytes). Untimed.
TILES = {
    "gpu": (Tiles(16, 32, 4, 2), Tiles(32, 32, 8, 2)),
    "gpu-fp8": (Tiles(16, 16, 8, 2), Tiles(16, 16, 8, 2)),
    "fma": (Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),  # fp32, or before sm_80
    "interpreter": (Tiles(16, 16, 4, 1), Tiles(16, 16, 4, 1)),  # small, so that small tests cross tiles
}
MAX_SPLITS = 32


def tiles_for(q: Tensor, fp8: bool) -> tuple[Tiles, Tiles]:
    """The (decode, prefill) tiles for queries ``q`` over bf16 or fp8 rows."""
    if q.device.type != "cuda":
        return TILES["interpreter"]
    if q.dtype == torch.float32 or torch.cuda.get_device_capability(q.device)[0] < 8:
        return TILES["fma"]
    return TILES["gpu-fp8" if fp8 else "gpu"]


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


@dataclass(frozen=True)
class Planes:
    """Where the parts of a cache row lie, for the kernels: each part as a view whose
    first element is that part of the first row, and the row's length in its elements."""

    latent: Tensor
    rope: Tensor
    scales: Tensor  # fp32 group scales (fp8 rows; else a stand-in)
    fp8: bool
    group: int  # latent values per scale

    @staticmethod
    def of(cache: Tensor, rank: int, fp8: bool) -> Planes:
        assert cache.is_contiguous(), "a latent cache is [num_blocks, block_size, row], contiguous"
        if not fp8:
            return Planes(cache, cache[..., rank:], cache, False, rank)
        assert rank & (rank - 1) == 0, f"the fp8 kernels take a power-of-two kv_lora_rank, got {rank}"
        groups = fp8_groups(rank)
        scales, rope = (
            cache.view(torch.float32)[..., rank // 4 :],
            cache.view(torch.bfloat16)[..., rank // 2 + 2 * groups :],
        )
        return Planes(cache, rope, scales, True, rank // groups)

    def constexprs(self) -> dict:
        strides = dict(LATENT_STRIDE=self.latent.stride(1), ROPE_STRIDE=self.rope.stride(1),
                       SCALE_STRIDE=self.scales.stride(1))  # fmt: skip
        return dict(FP8=self.fp8, GROUP=self.group, **strides)


def mla_attention(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor | None,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uv: Tensor | None = None,
    num_splits: int | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
) -> Tensor:
    """:func:`xinfer_deepseek.mla_ops.mla_attention` in Triton; ``num_splits`` (decode) and
    ``tiles`` (decode, prefill) override the defaults, for tests and tuning."""
    rank = q_latent.shape[-1]
    planes = Planes.of(cache, rank, fp8=False)
    return _attention(q_latent, q_rope, latent, cache, planes, meta, scale, w_uv, num_splits, tiles)


def mla_attention_fp8(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uv: Tensor | None = None,
    num_splits: int | None = None,
    tiles: tuple[Tiles, Tiles] | None = None,
) -> Tensor:
    """:func:`xinfer_deepseek.mla_ops.mla_attention_fp8` in Triton: the step's rows are encoded
    (:func:`~xinfer_deepseek.mla_ops.encode_fp8`, torch ops, no host syncs) and stored, and
    the kernels decode the cache's latents in registers."""
    rank = q_latent.shape[-1]
    rows = encode_fp8(latent, rank)
    planes = Planes.of(cache, rank, fp8=True)
    return _attention(q_latent, q_rope, rows, cache, planes, meta, scale, w_uv, num_splits, tiles)


# Decode steps of at most this many tokens up-project their values as they merge. Each merging program reads
# its chunk of w_uv, so a step reads w_uv (2 MB at Moonlight's shape) once per sequence from L2, where a
# batched GEMM launch reads it once: untimed, chosen where that is still a few microseconds.
EXPAND_MAX_TOKENS = 8
CHUNK_R, CHUNK_V = 128, 32  # a merging program's latent columns per step, and its output columns


def _attention(
    q_latent: Tensor,
    q_rope: Tensor,
    rows: Tensor | None,
    cache: Tensor,
    planes: Planes,
    meta: AttentionMetadata,
    scale: float,
    w_uv: Tensor | None,
    num_splits: int | None,
    tiles: tuple[Tiles, Tiles] | None,
) -> Tensor:
    """Store ``rows`` [T, row] (as the cache holds them; None: stored already), then attend
    (:func:`mla_attention`).

    A decode step of at most :data:`EXPAND_MAX_TOKENS` tokens always splits its contexts, and
    the reduce up-projects each head's merged latent by ``w_uv`` (every program reads a chunk of
    one head's, a batched GEMM launch fewer); other steps up-project after attention."""
    num_tokens, num_heads, rank = q_latent.shape
    _, block_size, width = cache.shape
    rope_dim = q_rope.shape[-1]
    q_latent, q_rope = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_latent, q_rope))
    fused_expand = w_uv is not None and meta.max_seqlen_q == 1 and num_tokens <= EXPAND_MAX_TOKENS
    if fused_expand:
        assert w_uv is not None and w_uv.stride(-1) == 1
        out = q_latent.new_empty((num_tokens, num_heads * w_uv.shape[1]))
    else:
        out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out if fused_expand or w_uv is None else expand(out, w_uv)
    launch, lent = launch_chain(q_latent.device), helpers()
    if rows is not None:
        assert rows.shape[-1] == width, (rows.shape, cache.shape)
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        _store_kernel[(num_tokens,)](rows, cache, meta.slot_mapping, rows.stride(0), WIDTH=width,
                                     BLOCK_W=triton.next_power_of_2(width), **launch)  # fmt: skip

    decode_tiles, prefill_tiles = tiles or tiles_for(q_latent, planes.fp8)
    args = (q_latent, q_rope, planes.latent, planes.rope, planes.scales, out, meta.cu_seqlens_q, meta.seq_lens,
            meta.block_tables)  # fmt: skip
    strides = (*q_latent.stride()[:2], *q_rope.stride()[:2], *out.stride()[:2], meta.block_tables.stride(0))
    constexprs = dict(BLOCK_SIZE=block_size, R=rank, P=rope_dim, BLOCK_R=max(DOT_MIN, triton.next_power_of_2(rank)),
                      BLOCK_P=max(DOT_MIN, triton.next_power_of_2(rope_dim)), **planes.constexprs(),
                      PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", FP8_VALUE=lent.fp8_value,
                      **launch)  # fmt: skip
    score_scale = scale * LOG2E  # (softmax in base 2)

    if meta.max_seqlen_q > 1:
        block_h = min(triton.next_power_of_2(num_heads), prefill_tiles.block_m)
        q_per_tile = prefill_tiles.block_m // block_h
        # tiles from shapes only (graph-safe): see KernelHelpers.tile_owner
        grid = (num_tokens // q_per_tile + meta.num_seqs, triton.cdiv(num_heads, block_h))
        _prefill_kernel[grid](
            *args, meta.num_seqs, num_heads, score_scale, *strides, Q_PER_TILE=q_per_tile, BLOCK_H=block_h,
            BLOCK_N=prefill_tiles.block_n, num_warps=prefill_tiles.num_warps, num_stages=prefill_tiles.num_stages,
            TILE_OWNER=lent.tile_owner,
            **constexprs,
        )  # fmt: skip

    block_h = max(DOT_MIN, min(triton.next_power_of_2(num_heads), decode_tiles.block_m))
    head_groups = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        max_context = meta.block_tables.shape[1] * block_size
        min_split = 4 * decode_tiles.block_n
        num_splits = decode_num_splits(meta.num_seqs, head_groups, max_context, _num_sms(q_latent.device), min_split)
        num_splits = min(num_splits, MAX_SPLITS)
    partial = num_splits > 1 or fused_expand
    parts = (out, out, out)  # (unused with one split: the programs write the output)
    if partial:  # each split's acc [R], max and sum per (sequence, head)
        part_shape = (meta.num_seqs, num_heads, num_splits)
        parts = (out.new_empty((*part_shape, rank), dtype=torch.float32),
                 out.new_empty(part_shape, dtype=torch.float32), out.new_empty(part_shape, dtype=torch.float32))  # fmt: skip
    _decode_kernel[(head_groups, meta.num_seqs, num_splits)](
        *args, *parts, num_heads, num_splits, score_scale, *strides, BLOCK_H=block_h, BLOCK_N=decode_tiles.block_n,
        PARTIAL=partial, num_warps=decode_tiles.num_warps, num_stages=decode_tiles.num_stages, **constexprs,
    )  # fmt: skip
    if partial:
        chunk_r = min(CHUNK_R, triton.next_power_of_2(rank))
        if fused_expand:
            assert w_uv is not None
            v_dim = w_uv.shape[1]
            chunk_v = min(CHUNK_V, triton.next_power_of_2(v_dim))
            chunks, weights, out_strides = triton.cdiv(v_dim, chunk_v), w_uv, (out.stride(0), v_dim)
        else:  # (out stands in for w_uv)
            v_dim = chunk_v = 1
            chunks, weights, out_strides = triton.cdiv(rank, chunk_r), out, (out.stride(0), out.stride(1))
        w_strides = (weights.stride(0), weights.stride(1)) if fused_expand else (0, 0)
        _reduce_kernel[(meta.num_seqs, num_heads, chunks)](
            out, *parts, meta.cu_seqlens_q, meta.seq_lens, weights, num_heads, num_splits, *out_strides, *w_strides,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits), BLOCK_N=decode_tiles.block_n, R=rank, CHUNK_R=chunk_r,
            EXPAND=fused_expand, V=v_dim, CHUNK_V=chunk_v, num_warps=4, **launch,
        )  # fmt: skip
    return out if fused_expand or w_uv is None else expand(out, w_uv)
