"""The CUDA prefill kernel with ``AttentionMetadata.key_limits`` (Gemma 3's image tokens see their
whole image: query row i sees keys up to position key_limits[i]) against the plain-torch reference.
Conventions and helpers as in test_cuda_kernels.py."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from tests.backends.test_cuda_kernels import CPU, DEVICE, ON_GPU, Batch, check, make_batch, ref32, run_attention
from xinfer.kv import LayerKVCache

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def with_items(batch: Batch, q_lens: list[int], seq_lens: list[int], item_len: int, seed: int) -> Batch:
    """``batch`` with key limits: in each prompt chunk of more than one query, spans of up to
    ``item_len`` queries (the items) see up to their span's last position; other rows up to themselves."""
    rng = random.Random(seed)
    limits: list[int] = []
    for q_len, seq_len in zip(q_lens, seq_lens):
        positions = list(range(seq_len - q_len, seq_len))
        row = 0
        while row < q_len:
            length = rng.randint(2, item_len) if q_len > 1 and rng.random() < 0.6 else 1
            span = positions[row : row + length]
            limits += [span[-1]] * len(span)
            row += len(span)
    key_limits = torch.tensor(limits, dtype=torch.int32, device=DEVICE)
    return Batch(batch.q, batch.k_cache, batch.v_cache, replace(batch.meta, key_limits=key_limits))


def reference(batch: Batch, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    m = batch.meta
    meta = replace(m, **{f: getattr(m, f).cpu() for f in ("cu_seqlens_q", "seq_lens", "block_tables", "slot_mapping", "key_limits")})  # fmt: skip
    cache = LayerKVCache.plain(ref32(batch.k_cache), ref32(batch.v_cache))
    return CPU.attend(ref32(batch.q), cache, meta, scale, window, softcap)


# (q_lens, seq_lens, heads, KV heads, head dim, block size, the longest item)
SMALL = [
    ([37], [37], 4, 1, 64, 16, 20),
    ([23, 1, 9, 1], [23, 17, 50, 1], 8, 2, 64, 16, 8),  # prefix-cached chunks beside decodes
    ([40, 6], [60, 6], 4, 2, 72, 8, 30),  # a head dim no power of two
]
LARGE = [
    ([600, 1, 300], [600, 900, 1400], 8, 4, 256, 16, 260),  # Gemma 3 images: 256 tokens each
    ([1100], [1100], 16, 8, 128, 16, 256),
]


@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (None, 5.0)])
@pytest.mark.parametrize("case", LARGE if ON_GPU else SMALL)
def test_prefill_with_key_limits(case, window, softcap):
    q_lens, seq_lens, heads, kv_heads, head_dim, block_size, item_len = case
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    window = window * 60 if window and ON_GPU else window
    batch = make_batch(q_lens, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    batch = with_items(batch, q_lens, seq_lens, item_len, seed=len(q_lens))
    out = run_attention(batch, 0.5, window, softcap)
    check(out, reference(batch, 0.5, window, softcap), dtype)


def test_key_limits_change_the_output():
    """The limits are read: rows of an item differ from the causal result, the others do not."""
    batch = make_batch([20], [20], 2, 1, 32, 8, torch.float32)
    limits = torch.arange(20, dtype=torch.int32, device=DEVICE)
    limits[4:12] = 11  # one item at rows 4..11
    causal = run_attention(batch, 0.5)
    out = run_attention(Batch(batch.q, batch.k_cache, batch.v_cache, replace(batch.meta, key_limits=limits)), 0.5)
    assert torch.equal(out[:4], causal[:4]) and torch.allclose(out[12:], causal[12:])
    assert not torch.allclose(out[4:11], causal[4:11])
    assert torch.allclose(out[11], causal[11])  # the item's last row sees what it saw causally
