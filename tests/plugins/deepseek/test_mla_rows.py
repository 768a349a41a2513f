"""The absorbed form's ops against the expanded attention transformers' DeepseekV3Attention computes: the
reference of ``mla_rows`` (absorbed queries, rotated rope parts, normed cache rows) and ``mla_attention`` with
the value up-projection ``w_uv`` give the expanded form's outputs, written from transformers' rotary and norm;
the Triton kernels (``mla_rows`` in one launch, the decode's merge up-projecting the values) against the
references on the device ``XINFER_KERNEL_DEVICE`` picks (tests/conftest.py; "cpu": the Triton interpreter)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm, apply_rotary_pos_emb

from tests.plugins.deepseek.test_mla_op import BATCHES, KERNEL_TOL, paged_step
from xinfer.ops import AttentionMetadata, Rotation
from xinfer_deepseek.kernels import mla, mla_rows
from xinfer_deepseek.mla_ops import mla_attention
from xinfer_deepseek.mla_ops import mla_rows as reference_rows

pytestmark = pytest.mark.usefixtures("cuda_backend")
DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])
ON_GPU = DEVICE.type == "cuda"
HALF_DTYPE = torch.bfloat16 if ON_GPU else torch.float16  # (the interpreter computes in numpy: no bfloat16)


def projections(tokens: int, heads: int, nope: int, rope: int, rank: int, v_dim: int, dtype=torch.float32, seed=0):
    """A step's projections as the layer makes them (``q`` a view of the query projection's output), a rotary
    table of 64 positions (cos || sin of random angles), the latent norm's weight and ``kv_b_proj``'s halves."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads * (nope + rope) + 8, generator=g)[:, 8:].view(tokens, heads, nope + rope)
    kv = torch.randn(tokens, rank + rope, generator=g) * 3
    angles = torch.rand(64, rope // 2, generator=g) * 6.3
    rotation = Rotation(torch.randint(0, 64, (tokens,), generator=g), torch.cat([angles.cos(), angles.sin()], -1))
    norm_weight = 1 + torch.randn(rank, generator=g) / 4
    w_uk, w_uv = torch.randn(heads, nope, rank, generator=g) / 8, torch.randn(heads, v_dim, rank, generator=g) / 8
    return q.to(dtype), kv.to(dtype), rotation, norm_weight, w_uk.to(dtype), w_uv.to(dtype)


def test_absorbed_attention_equals_the_expanded_form():
    """One causal prompt of 9 tokens: ``mla_rows`` then ``mla_attention`` with ``w_uv`` against each head's
    expanded keys ``[W_UK c, k_rope]`` and values ``W_UV c``, rotated and normed by transformers' code."""
    tokens, heads, nope, rope, rank, v_dim = 9, 3, 8, 4, 16, 6
    q, kv, rotation, norm_weight, w_uk, w_uv = projections(tokens, heads, nope, rope, rank, v_dim)
    rotation = Rotation(torch.arange(tokens), rotation.cos_sin)
    scale = (nope + rope) ** -0.5

    q_latent, q_rope, rows = reference_rows(q, kv, rotation, norm_weight, 1e-6, w_uk)
    cache = torch.full((2, 16, rank + rope), float("nan"))
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        block_tables=torch.tensor([[1]], dtype=torch.int32),
        slot_mapping=16 + torch.arange(tokens),
        max_seqlen_q=tokens,
        max_seq_len=tokens,
    )
    out = mla_attention(q_latent, q_rope, rows, cache, meta, scale, w_uv)

    norm = DeepseekV3RMSNorm(rank, eps=1e-6)
    norm.weight.data = norm_weight
    latent = norm(kv[:, :rank])  # [T, R]
    cos, sin = (half[rotation.positions].repeat(1, 2) for half in rotation.cos_sin.chunk(2, dim=-1))
    q_rot, k_rot = apply_rotary_pos_emb(q[..., nope:].transpose(0, 1), kv[None, :, rank:], cos, sin, 0)  # [H, T, P]
    keys = torch.cat([torch.einsum("hnr,tr->htn", w_uk, latent), k_rot.expand(heads, -1, -1)], dim=-1)
    values = torch.einsum("hvr,tr->htv", w_uv, latent)
    queries = torch.cat([q[..., :nope].transpose(0, 1), q_rot], dim=-1)
    expected = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
    torch.testing.assert_close(out, expected.transpose(0, 1).flatten(1), rtol=1e-5, atol=1e-5)


# (tokens, heads, nope, rope, rank): one token and a few (w_uk in the rows' launch), more than it takes
# (a batched GEMM); 20 heads (a padded head block), latent columns in several chunks
ROWS_CASES = [(1, 20, 16, 8, 32), (3, 4, 16, 8, 256), (mla_rows.ABSORB_MAX_TOKENS + 3, 5, 16, 8, 32)]


@pytest.mark.parametrize("dtype", [torch.float32, HALF_DTYPE], ids=str)
@pytest.mark.parametrize("tokens, heads, nope, rope, rank", ROWS_CASES, ids=str)
def test_rows_kernel_matches_the_reference(tokens, heads, nope, rope, rank, dtype):
    """Also storing the rows into a cache (NaN where nothing is written), the first token padding (slot -1)."""
    q, kv, rotation, norm_weight, w_uk, _ = projections(tokens, heads, nope, rope, rank, 4, dtype, seed=tokens)
    cache = torch.full((4, 16, rank + rope), float("nan"), dtype=dtype)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:tokens]
    slots[0] = -1
    expected_cache = cache.clone()
    expected = reference_rows(q, kv, rotation, norm_weight, 1e-6, w_uk, expected_cache, slots)
    on_device = Rotation(rotation.positions.to(DEVICE), rotation.cos_sin.to(DEVICE))
    q, kv, norm_weight, w_uk, cache, slots = (t.to(DEVICE) for t in (q, kv, norm_weight, w_uk, cache, slots))
    got = mla_rows.mla_rows(q, kv, on_device, norm_weight, 1e-6, w_uk, cache, slots)
    tol = KERNEL_TOL[dtype]
    for name, value, reference in zip(("q_latent", "q_rope", "rows"), got, expected):
        assert value.dtype == dtype and value.shape == reference.shape, name
        torch.testing.assert_close(value.cpu().float(), reference.float(), rtol=tol, atol=tol, msg=name)
    assert expected_cache.isnan().sum() == (64 - tokens + 1) * (rank + rope)
    torch.testing.assert_close(cache.cpu(), expected_cache, rtol=tol, atol=tol, equal_nan=True)


def test_rows_kernel_at_deepseek_v3_sizes():
    """16 heads of N 128 + P 64, R 512: w_uk in four column chunks per head, the latent row a 512-wide norm."""
    q, kv, rotation, norm_weight, w_uk, _ = projections(2, 16, 128, 64, 512, 4, HALF_DTYPE)
    expected = reference_rows(q, kv, rotation, norm_weight, 1e-6, w_uk)
    on_device = Rotation(rotation.positions.to(DEVICE), rotation.cos_sin.to(DEVICE))
    got = mla_rows.mla_rows(q.to(DEVICE), kv.to(DEVICE), on_device, norm_weight.to(DEVICE), 1e-6, w_uk.to(DEVICE))
    for value, reference in zip(got, expected):
        torch.testing.assert_close(value.cpu().float(), reference.float(), rtol=2e-2, atol=2e-2)


def with_values(step, v_dim: int) -> Tensor:
    heads, rank = step.q_latent.shape[1:]
    return (torch.randn(heads, v_dim, rank, generator=torch.Generator().manual_seed(7)) / 4).to(step.q_latent.dtype)


# (batch, num_splits, dtype): decode steps whose merge up-projects (split, and one split kept as a partial),
# and a mixed step, up-projected after attention
EXPAND_CASES = [("decode", None, torch.float16), ("decode", 1, torch.float32), ("mixed-padded", 3, torch.float32)]


@pytest.mark.parametrize("batch, num_splits, dtype", EXPAND_CASES, ids=str)
def test_attention_kernel_up_projects_values_as_the_reference(batch, num_splits, dtype):
    q_lens, context_lens, pad_tokens, pad_seqs = BATCHES[batch]
    step = paged_step(q_lens, context_lens, heads=5, rank=32, rope=16, dtype=dtype, pad_tokens=pad_tokens,
                      pad_seqs=pad_seqs, seed=5)  # fmt: skip
    w_uv = with_values(step, v_dim=40)  # (two output chunks per head, the second part padding)
    expected = mla_attention(*step.args(), w_uv)
    out = mla.mla_attention(*step.args(DEVICE), w_uv.to(DEVICE), num_splits=num_splits)
    assert out.shape == (len(step.q_latent), 5 * 40) and out.dtype == dtype
    rows = slice(0, sum(q_lens))  # (rows of no sequence are left as they are)
    tol = KERNEL_TOL[dtype]
    torch.testing.assert_close(out[rows].cpu().float(), expected[rows].float(), rtol=tol, atol=tol)
