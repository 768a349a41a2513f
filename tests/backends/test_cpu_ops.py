"""The CPU backend's own ops against the torch reference they stand in for (:class:`xinfer.torch_ops.TorchOps`):
the same tokens from the sampler, the same attention, norms, rotary and cache contents."""

from dataclasses import replace

import pytest
import torch

import xinfer_cpu.sampling
from xinfer import SamplingParams
from xinfer.forward_context import forward_context
from xinfer.kv import get_format
from xinfer.ops import AttentionMetadata, HeadNorms, StepContext
from xinfer.sampling import SampledRow, SamplingBatch
from xinfer.torch_ops import TorchOps
from xinfer_cpu.ops import CpuOps

REFERENCE, CPU = TorchOps(), CpuOps()


def batch(params: list[SamplingParams]) -> SamplingBatch:
    return SamplingBatch.of([SampledRow(p, seed=1000 + i, position=7 * i) for i, p in enumerate(params)])


def logits(rows: int, vocab: int, scale: float, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


TOP_P_ROWS = [
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0, top_p=0.5, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=0.0, top_p=0.9),  # greedy in the batch
]
WIDE_TOP_K = SamplingParams(temperature=0.7, top_p=0.99, top_k=3000)  # a top-k past the first candidates


@pytest.mark.parametrize("params", [TOP_P_ROWS, [*TOP_P_ROWS, WIDE_TOP_K]], ids=["top-p", "wide-top-k"])
@pytest.mark.parametrize("scale", [8.0, 3.0, 0.3])  # peaked (few candidates) to flat (the reference's sort)
def test_top_p_draws_the_references_tokens(params, scale, monkeypatch):
    reference_draws = []
    reference = xinfer_cpu.sampling.torch_sampling.sample
    monkeypatch.setattr(
        xinfer_cpu.sampling.torch_sampling, "sample", lambda *a: reference_draws.append(1) or reference(*a)
    )
    fallbacks = 0
    for seed in range(4):
        x = logits(len(params), 5000, scale, seed)
        x[:, 100:110] = x[:, 100:101]  # ties
        expected = REFERENCE.sample(x, batch(params))
        before = len(reference_draws)
        assert torch.equal(CPU.sample(x, batch(params)), expected)
        fallbacks += len(reference_draws) - before
    assert bool(fallbacks) == (scale < 1)  # the candidates hold the top-p set unless the logits are flat


def test_rows_without_top_p_and_greedy_batches_draw_the_references_tokens():
    x = logits(3, 5000, 4.0)
    for params in ([SamplingParams(temperature=0.9)] * 3, [SamplingParams(temperature=0)] * 3):
        assert torch.equal(CPU.sample(x, batch(params)), REFERENCE.sample(x, batch(params)))


def paged(seq_lens: list[int], block_size: int, kv_heads: int, head_dim: int, format_name: str = "auto"):
    """Random K/V of ``seq_lens`` contexts in a cache of shuffled blocks, and a decode step's metadata over it."""
    generator = torch.Generator().manual_seed(1)
    widths = [-(-n // block_size) for n in seq_lens]
    order = torch.randperm(sum(widths) + 2, generator=generator).tolist()
    tables = [order[sum(widths[:b]) : sum(widths[: b + 1])] for b in range(len(seq_lens))]
    cache = get_format(format_name).allocate(len(order), block_size, kv_heads, head_dim, torch.float32, "cpu")
    slots = torch.tensor([t[p // block_size] * block_size + p % block_size
                          for t, n in zip(tables, seq_lens) for p in range(n)])  # fmt: skip
    k, v = (torch.randn(len(slots), kv_heads, head_dim, generator=generator) for _ in range(2))
    REFERENCE.write_kv(k, v, cache, slots)
    width = max(widths)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(
            [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, seq_lens)]
        ),
        max_seqlen_q=1,
        max_seq_len=max(seq_lens),
    )
    return cache, meta


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("format_name", ["auto", "turbo4"])
def test_decode_attention_of_every_sequence_at_once_is_the_references(window, format_name):
    cache, meta = paged([1, 37, 16, 9], block_size=8, kv_heads=2, head_dim=16, format_name=format_name)
    if window is not None:
        meta.block_tables[1, :4] = -1  # blocks wholly before the window, dropped (positions 0-31 of 37)
    q = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(2))
    expected = REFERENCE.attend(q, cache, meta, 0.25, window)
    with forward_context(StepContext([meta])):  # the mask is made once a step
        got = CPU.attend(q, cache, meta, 0.25, window)
        again = CPU.attend(q, cache, meta, 0.25, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(again, got)


@pytest.mark.parametrize("window", [None, 5])
def test_a_sequences_attention_does_not_depend_on_the_rest_of_the_batch(window):
    """Bit for bit: seeded and greedy requests give the same tokens whatever else is in the batch."""
    cache, meta = paged([9, 37, 16, 9], block_size=8, kv_heads=2, head_dim=16)
    q = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(2))
    with forward_context(StepContext([meta])):
        batched = CPU.attend(q, cache, meta, 0.25, window)
    for row, length in enumerate(meta.seq_lens.tolist()):  # each row, wherever it sits in the batch
        alone = replace(meta, cu_seqlens_q=meta.cu_seqlens_q[:2], seq_lens=meta.seq_lens[row : row + 1],
                        block_tables=meta.block_tables[row : row + 1, : -(-length // 8)],
                        slot_mapping=meta.slot_mapping[row : row + 1], max_seq_len=length)  # fmt: skip
        with forward_context(StepContext([alone])):
            assert torch.equal(CPU.attend(q[row : row + 1], cache, alone, 0.25, window), batched[row : row + 1])


def test_kv_write_stores_what_the_reference_stores_and_skips_padding():
    for slots in (torch.tensor([5, 0, 17]), torch.tensor([5, -1, 17])):
        caches = [get_format("auto").allocate(4, 8, 2, 16, torch.float32, "cpu") for _ in range(2)]
        k, v = torch.randn(2, 3, 2, 16).unbind(0)
        REFERENCE.write_kv(k, v, caches[0], slots)
        CPU.write_kv(k, v, caches[1], slots)
        assert all(torch.equal(caches[0][n], caches[1][n]) for n in ("k", "v"))


@pytest.mark.parametrize("rotary_dim", [16, 8])  # whole heads, then partial rotary
def test_norms_and_rotary_are_the_references(rotary_dim):
    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(5, 4, 16, generator=generator), torch.randn(5, 2, 16, generator=generator)
    positions = torch.tensor([0, 3, 4, 9, 30])
    angles = torch.outer(torch.arange(32.0), 1.0 / 100 ** (torch.arange(0, rotary_dim, 2) / rotary_dim))
    cos_sin = torch.cat((angles.cos(), angles.sin()), -1)
    norms = HeadNorms(torch.rand(16, generator=generator) + 0.5, torch.rand(16, generator=generator) + 0.5, 1e-6)
    qkv = torch.randn(5, 8 * 16, generator=generator)  # q and k as a merged projection gives them: one buffer
    merged = qkv[:, :64].view(5, 4, 16), qkv[:, 64:96].view(5, 2, 16)
    for (queries, keys), head_norms in [((q, k), None), ((q, k), norms), (merged, None), (merged, norms)]:
        for got, expected in zip(CPU.rotary(queries, keys, positions, cos_sin, head_norms),
                                 REFERENCE.rotary(queries, keys, positions, cos_sin, head_norms)):  # fmt: skip
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    x, residual, weight = torch.randn(3, 5, 64, generator=generator)
    torch.testing.assert_close(CPU.rms_norm(x, weight[0], 1e-5), REFERENCE.rms_norm(x, weight[0], 1e-5))
    for got, expected in zip(
        CPU.rms_norm(x, weight[0], 1e-5, residual), REFERENCE.rms_norm(x, weight[0], 1e-5, residual)
    ):
        torch.testing.assert_close(got, expected)
