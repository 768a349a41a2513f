"""Multi-head latent attention over a paged latent cache: the ops' plain-torch references.

Each token of a layer keeps one cache row shared by all heads: its normalised latent
(``R`` = kv_lora_rank) followed by its rotated rope key (``P`` = qk_rope_head_dim).
Attention runs in the absorbed form: the key up-projection is folded into the query
(``q_latent``, by :func:`mla_rows`, which also makes the step's rows from the latent
projection), so every head scores the same rows; the op returns each head's
softmax-weighted sum of latents, or, given the value up-projection ``w_uv``, each head's
output (the up-projection in the op, where a kernel can apply it as it merges).

Two row formats, one op each:

- ``mla_attention``: the row as it is, ``R + P`` values in the cache's dtype.
- ``mla_attention_fp8``: ``fp8_row_bytes(R, P)`` bytes (uint8 cache), the layout vLLM
  and SGLang use, 656 bytes at DeepSeek V3's 512 + 64 against 1152 in bf16::

      [0, R)              the latent in e4m3, in G = ceil(R / 128) groups of R / G values,
                          each value x as x * 448 / (its group's absmax)
      [R, R + 4G)         the G groups' absmax scales, fp32
      [R + 4G, ... + 2P)  the rope key in bf16

  The error of a latent value is at most 1/16 of it plus its group's absmax x 2**-18.

The code of ``x`` is the e4m3 rounding (half to even) of ``fl32(fl32(x * 448) / absmax)``: two fp32 ops,
each rounded once on every device (the product is exact for 16-bit inputs). Dividing by the step
``absmax / 448`` instead would round the step first, and differently by device: torch on CUDA divides by a
Python number as a product with its reciprocal, one ulp off the CPU's quotient half the time, enough to move
a code across a rounding boundary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from xinfer.kv import codes
from xinfer.kv.codes import FP8_MAX
from xinfer.ops import AttentionMetadata, Rotation
from xinfer.torch_ops import gather_context

FP8_GROUP = 128  # latent values per scale at most


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
    """The attention ops' inputs from the step's projections: ``q`` [T, H, N + P] (each head's
    part without rope, then its rope part) and ``kv`` [T, R + P] (the latent, then the rope key),
    as the projections give them. Returns

        q_latent [T, H, R] = q[..., :N] @ w_uk[h]        (w_uk [H, N, R]: the key up-projection)
        q_rope   [T, H, P] = rotary(q[..., N:])
        rows     [T, R + P] = rms_norm(kv[:, :R]) * norm_weight || rotary(kv[:, R:])

    the norm in fp32 and the rotation (rotate-half, by ``rotation``'s table rows at its positions,
    over all P dims) in fp32, each rounded once to the input's dtype. With ``cache`` (of rows as they
    are, :func:`mla_attention`'s) it also stores the rows there at ``slot_mapping`` (negative: skipped),
    so that the attention op need not."""
    assert rotation.norms is None and rotation.cos_sin.shape[-1] == q.shape[-1] - w_uk.shape[1], "P rotated dims"
    nope, rank = w_uk.shape[1:]
    q_nope, q_rope = q.split([nope, q.shape[-1] - nope], dim=-1)
    latent, k_rope = kv.split([rank, kv.shape[-1] - rank], dim=-1)
    cos, sin = rotation.cos_sin[rotation.positions].float().chunk(2, dim=-1)  # [T, P / 2] each
    latent32 = latent.float()
    normed = latent32 * torch.rsqrt(latent32.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    rows = torch.cat([normed.to(kv.dtype), rotate_halves(k_rope[:, None], cos, sin)[:, 0]], dim=-1)
    q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
    if cache is not None:
        assert slot_mapping is not None
        store(cache, rows.to(cache.dtype), slot_mapping)
    return q_latent, rotate_halves(q_rope, cos, sin), rows


def rotate_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` [T, H, P] rotated by ``cos``, ``sin`` [T, P / 2] (fp32): its halves as the pairs."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def expand(o_latent: Tensor, w_uv: Tensor) -> Tensor:
    """Each head's output from its latent one: ``o_latent`` [T, H, R] @ ``w_uv[h]``ᵀ ([H, V, R]) -> [T, H * V]."""
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).flatten(1)


def mla_attention(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor | None,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uv: Tensor | None = None,
) -> Tensor:
    """Store this step's ``latent`` [T, R + P] in ``cache`` [num_blocks, block_size, R + P] at
    ``meta.slot_mapping`` (negative: skipped), then causal paged attention of the queries
    ``q_latent`` [T, H, R] and ``q_rope`` [T, H, P] over each sequence's cached rows::

        s[t, h, j] = scale * (q_latent[t, h] . row_j[:R] + q_rope[t, h] . row_j[R:]),  j <= position of t
        out[t, h] = sum_j softmax_j(s[t, h]) * row_j[:R]

    in fp32. Returns [T, H, R] in the dtype of ``q_latent``, or with ``w_uv`` [H, V, R] (the
    value up-projection) ``expand(out, w_uv)`` [T, H * V]; rows of no sequence are zero. ``latent``
    None: the step's rows are in the cache already (:func:`mla_rows` stored them)."""
    if latent is not None:
        store(cache, latent.to(cache.dtype), meta.slot_mapping)
    out = attend(q_latent, q_rope, meta, scale, lambda b, n: gather_context(cache, meta.block_tables[b], n).float())
    return out if w_uv is None else expand(out, w_uv)


def mla_attention_fp8(
    q_latent: Tensor,
    q_rope: Tensor,
    latent: Tensor,
    cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    w_uv: Tensor | None = None,
) -> Tensor:
    """:func:`mla_attention` over a cache of fp8 rows (the module's docstring): ``cache`` is
    uint8 [num_blocks, block_size, fp8_row_bytes(R, P)]."""
    rank = q_latent.shape[-1]
    store(cache, encode_fp8(latent, rank), meta.slot_mapping)
    out = attend(
        q_latent, q_rope, meta, scale, lambda b, n: decode_fp8(gather_context(cache, meta.block_tables[b], n), rank)
    )
    return out if w_uv is None else expand(out, w_uv)


def store(cache: Tensor, rows: Tensor, slot_mapping: Tensor) -> None:
    """``rows`` [T, width] into ``cache`` at ``slot_mapping`` (negative: skipped)."""
    written = slot_mapping >= 0
    cache.view(-1, cache.shape[-1])[slot_mapping[written]] = rows[written]


def attend(
    q_latent: Tensor, q_rope: Tensor, meta: AttentionMetadata, scale: float, context: Callable[[int, int], Tensor]
) -> Tensor:
    """Causal attention of each sequence's queries over its rows ``context(b, seq_len)`` [L, R + P] (fp32)."""
    rank = q_latent.shape[-1]
    q = torch.cat([q_latent, q_rope], dim=-1).float()  # [T, H, R + P]: one dot per row
    out = torch.zeros(q_latent.shape, dtype=torch.float32, device=q.device)
    cu = meta.cu_seqlens_q.tolist()
    for b, context_len in enumerate(meta.seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        rows = context(b, context_len)
        scores = scale * torch.einsum("qhd,kd->hqk", q[start:end], rows)
        q_pos = torch.arange(context_len - (end - start), context_len, device=q.device)
        visible = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,kr->qhr", probs, rows[:, :rank])
    return out.to(q_latent.dtype)


def fp8_groups(rank: int) -> int:
    assert fp8_row_fits(rank), f"fp8 rows split R in equal groups of at most {FP8_GROUP}, 4-aligned; R={rank}"
    return -(-rank // FP8_GROUP)


def fp8_row_fits(rank: int) -> bool:
    """Whether R splits into equal groups of at most 128 values, R a multiple of 4 (the fp32 scales follow the
    codes): DeepSeek's 512 does; a rank such as 30 or 260 has no fp8 row."""
    return rank % 4 == 0 and rank % -(-rank // FP8_GROUP) == 0


def fp8_row_bytes(rank: int, rope: int) -> int:
    """Bytes of a token's fp8 row: R codes, the groups' fp32 scales, P bf16 rope values."""
    return rank + 4 * fp8_groups(rank) + 2 * rope


def encode_fp8(rows: Tensor, rank: int) -> Tensor:
    """Rows [T, R + P] as fp8 rows [T, fp8_row_bytes(R, P)] (uint8)."""
    groups = rows[:, :rank].float().unflatten(-1, (fp8_groups(rank), -1))  # [T, G, R / G]
    absmax = codes.absmax(groups)  # [T, G]
    scaled = (groups * FP8_MAX / absmax.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)  # (the module's docstring)
    latent = scaled.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
    rope = rows[:, rank:].to(torch.bfloat16).contiguous()
    return torch.cat([latent, absmax.view(torch.uint8), rope.view(torch.uint8)], dim=1)


def decode_fp8(stored: Tensor, rank: int) -> Tensor:
    """fp8 rows [L, fp8_row_bytes(R, P)] as rows [L, R + P] (fp32)."""
    groups = fp8_groups(rank)
    bits = stored[:, :rank].unflatten(-1, (groups, -1))
    group_scales = stored[:, rank : rank + 4 * groups].contiguous().view(torch.float32)
    rope = stored[:, rank + 4 * groups :].contiguous().view(torch.bfloat16)
    latent = bits.view(torch.float8_e4m3fn).float() * group_scales.unsqueeze(-1) / FP8_MAX
    return torch.cat([latent.flatten(1), rope.float()], dim=1)
