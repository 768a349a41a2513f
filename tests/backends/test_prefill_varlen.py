"""The prefill kernel over a flat batch of many sequences, as a padded CUDA graph step
feeds it: query tiles are found per sequence inside the kernel, so short and long
sequences, one-query rows, empty padding sequences (no query, no context) and padding
tokens past the last sequence share one launch whose grid depends on shapes only."""

from __future__ import annotations

import pytest
import torch

from tests.backends.test_cuda_kernels import DEVICE, ON_GPU, Batch, check, make_batch, rand, run_attention
from xinfer.ops import AttentionMetadata

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

# (q_len, seq_len) per sequence; zeros are padding sequences
SMALL = [(1, 9), (37, 37), (0, 0), (1, 1), (5, 40), (16, 16), (1, 70), (9, 25), (2, 2), (0, 0), (0, 0)]
LARGE = [(700, 700), (1, 3000), (0, 0), (129, 1500), (1, 1), (33, 33), *[(1, 400 + 17 * i) for i in range(40)],
         (257, 2000), *[(0, 0)] * 30]  # fmt: skip


def padded(batch: Batch, pad_tokens: int) -> Batch:
    """``batch`` with ``pad_tokens`` query rows after the last sequence's (no sequence owns them)."""
    m = batch.meta
    q = torch.cat([batch.q, rand(pad_tokens, *batch.q.shape[1:], dtype=batch.q.dtype)])
    slots = torch.cat([m.slot_mapping, torch.full((pad_tokens,), -1, dtype=torch.int64, device=DEVICE)])
    meta = AttentionMetadata(m.cu_seqlens_q, m.seq_lens, m.block_tables, slots, q.shape[0], m.max_seq_len)
    return Batch(q, batch.k_cache, batch.v_cache, meta)


@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_prefill_many_sequences_with_padding(heads, kv_heads, window, softcap):
    q_lens, seq_lens = zip(*(LARGE if ON_GPU else SMALL))
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    window = window * 50 if window and ON_GPU else window
    batch = make_batch(list(q_lens), list(seq_lens), heads, kv_heads, 64, 16, dtype)
    num_tokens = sum(q_lens)
    ref = batch.reference(0.5, window, softcap)
    out = run_attention(padded(batch, 13), 0.5, window, softcap)
    check(out[:num_tokens], ref, dtype)


def test_prefill_grid_ignores_query_lengths():
    """The query and context lengths are read inside the kernel only: rewriting them in
    place (as a replayed CUDA graph sees them) needs no new launch parameters."""
    batch = make_batch([30, 1, 1, 0], [30, 40, 50, 45], 8, 2, 64, 16, torch.float32)
    meta = batch.meta
    check(run_attention(batch, 0.125), batch.reference(0.125, None, None), torch.float32)
    meta.cu_seqlens_q.copy_(torch.tensor([0, 1, 2, 3, 32], dtype=torch.int32))
    meta.seq_lens.copy_(torch.tensor([10, 40, 50, 45], dtype=torch.int32))
    check(run_attention(batch, 0.125), batch.reference(0.125, None, None), torch.float32)
