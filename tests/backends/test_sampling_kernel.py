"""The CUDA backend's sampling kernel draws the torch reference's tokens: same noise,
same kept sets (on the device ``XINFER_KERNEL_DEVICE`` picks; under the Triton interpreter
on the CPU). Small chunks split these small rows over several programs, and a small
region of none sends every boundary past it (settled alike if its tokens tie, else over
the whole row); the tests check which paths settled the rows where it matters."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from xinfer.sampling import SampledRow, SamplingBatch, SamplingParams
from xinfer.torch_sampling import noise, row_keys
from xinfer.torch_sampling import sample as reference
from xinfer_cuda.kernels.sampling import BOUNDARY, CANDIDATE, TIED, WHOLE_ROW, _gumbel, _noise_key, sample, sample_paths

DEVICE = torch.device(os.environ["XINFER_KERNEL_DEVICE"])

P = SamplingParams
ROWS = [
    SampledRow(P(temperature=0), 3, 0),
    SampledRow(P(temperature=1.0), 11, 5),
    SampledRow(P(temperature=0.8, top_p=0.95), 12, 9),
    SampledRow(P(temperature=0.7, top_p=0.3), 2**40 + 5, 17),
    SampledRow(P(temperature=1.1, top_k=7), -(2**63), 2**33),
    SampledRow(P(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02), 2**63 - 1, 1),
    SampledRow(P(temperature=1.5, min_p=0.2), 77, 123),
    SampledRow(P(temperature=0.5, top_k=1), 5, 5),
    SampledRow(P(temperature=0), 6, 6),
]


SPLITS = {
    "one chunk": {},
    "chunks": {"chunk": 64},
    "uneven chunks": {"chunk": 32},
    "whole-row": {"chunk": 64, "region": 0},
}


def draw(logits: torch.Tensor, batch: SamplingBatch, **split) -> list[int]:
    return sample(logits.to(DEVICE), batch.to(DEVICE), **split).cpu().tolist()


def draw_paths(logits: torch.Tensor, batch: SamplingBatch, **split) -> tuple[list[int], set[int]]:
    """The tokens, and the set of paths that settled the rows."""
    tokens, paths = sample_paths(logits.to(DEVICE), batch.to(DEVICE), **split)
    return tokens.cpu().tolist(), set(paths.cpu().tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", SPLITS)
def test_kernel_draws_the_reference_tokens(dtype, split):
    generator = torch.Generator().manual_seed(len(split))
    batch = SamplingBatch.of(ROWS)
    for trial in range(2):
        logits = (torch.randn(len(ROWS), 300, generator=generator) * (1 + 3 * trial)).to(dtype)
        logits[:, 5] = float("-inf")  # a masked token (min_tokens)
        logits[-1, [3, 8]] = logits[-1].max() + 1  # a greedy tie: the first wins
        got = draw(logits, batch, **SPLITS[split])
        assert got == reference(logits, batch).tolist()
        assert got[-1] == 3 and got[0] == logits[0].float().argmax()


FILTERS = [P(temperature=0.8, top_p=0.95), P(temperature=0.7, top_p=0.5), P(temperature=1.1, top_k=7),
           P(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02), P(temperature=1.0, top_k=100, top_p=0.3),
           P(temperature=1.5, min_p=0.2)]  # fmt: skip


@pytest.mark.parametrize("split", ["chunks", "whole-row"])
def test_kernel_draws_near_the_cuts_as_the_reference(split):
    """Many draws from one row: they reach the kept sets' least tokens, where the cuts decide."""
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1)) * 1.5
    rows = [SampledRow(FILTERS[i % len(FILTERS)], 1000 + i, i) for i in range(36)]
    batch = SamplingBatch.of(rows)
    expected = reference(logits.expand(len(rows), -1), batch).tolist()
    got, paths = draw_paths(logits.expand(len(rows), -1).contiguous(), batch, **SPLITS[split])
    assert got == expected
    assert len(set(expected)) >= 10
    crowded = {TIED, WHOLE_ROW} if split == "whole-row" else set()
    assert {CANDIDATE, BOUNDARY} <= paths and paths & {TIED, WHOLE_ROW} == crowded


@pytest.mark.parametrize("region", [2048, 4])
def test_kernel_keeps_ties_across_chunks_together(region):
    """Logits on a coarse grid: the k-th token and the top-p cut fall in runs of equal logits
    spread over chunks (past a small region: kept or dropped alike without gathering them);
    and a row with fewer finite logits than top_k."""
    generator = torch.Generator().manual_seed(2)
    logits = (torch.randn(8, 200, generator=generator) * 2).round()
    logits[7, 10:] = float("-inf")
    params = [P(temperature=1.0, top_k=12), P(temperature=1.0, top_p=0.6), P(temperature=0.5, top_k=30, top_p=0.9)]
    rows = [SampledRow(params[i % 3], 50 + i, i) for i in range(7)] + [SampledRow(P(temperature=1.0, top_k=50), 9, 9)]
    batch = SamplingBatch.of(rows)
    got, paths = draw_paths(logits, batch, chunk=32, region=region)
    assert got == reference(logits, batch).tolist()
    assert paths & {TIED, WHOLE_ROW} == ({TIED} if region == 4 else set())


def test_kernel_draws_a_row_alike_alone_and_in_a_batch():
    """Every kind of row (settled by its candidate or searched) draws alike beside any others."""
    logits = torch.randn(len(ROWS), 300, generator=torch.Generator().manual_seed(3)) * 2
    together = draw(logits, SamplingBatch.of(ROWS), chunk=64)
    alone = [draw(logits[i : i + 1], SamplingBatch.of([row]), chunk=64)[0] for i, row in enumerate(ROWS)]
    assert together == alone


def test_kernel_rows_past_the_logits_are_ignored_and_padding_is_greedy():
    batch = SamplingBatch.empty(6)
    batch.write(ROWS[1:3])  # rows 2.. are greedy padding
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    got = draw(logits, batch, chunk=32)
    assert got == reference(logits, batch).tolist()
    assert got[2:] == logits[2:].argmax(-1).tolist()


def test_kernel_settles_a_wide_boundary_as_the_reference():
    """6,000 tokens of spread-out logits: the top-p cuts fall among many tokens of similar mass."""
    logits = torch.randn(6000, generator=torch.Generator().manual_seed(4)) * 3
    params = [P(temperature=0.8, top_p=0.95), P(temperature=1.0, top_p=0.5), P(temperature=1.0, top_k=1000, top_p=0.5)]
    rows = [SampledRow(params[i % 3], 70 + i, i) for i in range(6)]
    batch = SamplingBatch.of(rows)
    wide = logits.expand(len(rows), -1).contiguous()
    assert draw(wide, batch, chunk=1024) == reference(wide, batch).tolist()


def test_kernel_settles_dummy_weight_rows_by_a_small_boundary():
    """Rows like a dummy-weight model's (N(0, 1.5) logits: a wide, smooth row) whose candidate
    top-p rejects: the exact bucket masses put the cut in one bucket of a few tokens, and the
    row is settled from them. (Bounding each bucket's mass by its count times its edges'
    weights left 60-80 tokens at these cuts: past this region, the whole-row settling; at a
    248k vocabulary, 2,000-5,000 tokens.)"""
    logits = torch.randn(8192, generator=torch.Generator().manual_seed(6)) * 1.5
    rows = []
    for temperature in (0.8, 1.0):
        tried = [SampledRow(P(temperature=temperature, top_p=0.95), 7, position) for position in range(300)]
        free = [SampledRow(P(temperature=temperature), 7, position) for position in range(300)]
        many = logits.expand(len(tried), -1)
        rejected = reference(many, SamplingBatch.of(free)) != reference(many, SamplingBatch.of(tried))
        rows += [tried[i] for i in rejected.nonzero().flatten()[:2]]  # the candidate is the unfiltered draw
    batch = SamplingBatch.of(rows)
    wide = logits.expand(len(rows), -1).contiguous()
    got, paths = draw_paths(wide, batch, chunk=2048, region=16)
    assert got == reference(wide, batch).tolist()
    assert len(rows) == 4 and paths == {BOUNDARY}


def test_kernel_draws_near_flat_rows_as_the_reference():
    """Near-flat rows over many chunks (high temperature, dummy weights): N(0, 0.01) in float16,
    runs of tied logits at the cuts; and a constant row, whose boundary is the whole row."""
    logits = (torch.randn(3, 5000, generator=torch.Generator().manual_seed(5)) * 0.01).to(torch.float16)
    logits[2] = 0.5
    params = [P(temperature=0.8, top_p=0.95), P(temperature=1.0, top_k=50, top_p=0.95), P(temperature=2.0, top_p=0.5)]
    rows = [SampledRow(params[i % 3], 90 + i, i) for i in range(3)]
    batch = SamplingBatch.of(rows)
    assert draw(logits, batch, chunk=64) == reference(logits, batch).tolist()


def test_kernel_draws_the_reference_over_many_positions_of_a_small_vocabulary():
    """The rows of the reference's distribution test, many positions each: candidates kept
    and not, for every filter, give the reference's draws (and so its distribution)."""
    logits = torch.tensor(SMALL_VOCABULARY)
    rows = [SampledRow(p, 4321, position) for position in range(12) for p in FILTERS_OF_THE_DISTRIBUTION_TEST]
    batch = SamplingBatch.of(rows)
    wide = logits.expand(len(rows), -1).contiguous()
    got = draw(wide, batch, chunk=8)
    assert got == reference(wide, batch).tolist()
    assert len(set(got)) >= 5  # most of the kept sets drawn


SMALL_VOCABULARY = [3.1, 2.9, 2.5, 2.4, 2.0, 1.7, 1.5, 1.1, 0.8, 0.6, 0.2, -0.3, -0.9, -1.4, -2.2, -3.0]
FILTERS_OF_THE_DISTRIBUTION_TEST = [
    P(temperature=1.3, top_k=5), P(temperature=1.0, top_p=0.8), P(temperature=0.9, min_p=0.12),
    P(temperature=0.8, top_k=9, top_p=0.9, min_p=0.05), P(temperature=1.0, top_p=0.3), P(temperature=1.0, top_k=3, top_p=0.5),
]  # fmt: skip


def test_kernel_draws_constant_rows_under_every_filter_as_the_reference():
    """Every token tied (the case a boundary search finds hardest): the candidate is kept
    under any filter, and is the reference's draw."""
    logits = torch.full((len(FILTERS), 3000), 1.25)
    rows = [SampledRow(p, 600 + i, i) for i, p in enumerate(FILTERS)]
    batch = SamplingBatch.of(rows)
    assert draw(logits, batch, chunk=256) == reference(logits, batch).tolist()


@triton.jit
def _noise_kernel(seed_ptr, position_ptr, out_ptr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + tokens, _gumbel(_noise_key(seed_ptr, position_ptr, 0), tokens))


def test_kernel_noise_is_the_reference_noise():
    """Every token's noise within 4e-6 of the reference's (on a GPU the kernel's logarithms are
    the hardware's approximate ones; the float32 noise itself has steps of 2e-6 near its top),
    over 2**20 tokens: all of the uniform's range, close to 1 too."""
    batch = SamplingBatch.of([SampledRow(P(), 2**40 + 9, 321)])
    tokens = 2**20
    got = torch.empty(tokens, device=DEVICE)
    on_device = batch.to(DEVICE)
    _noise_kernel[(tokens // 4096,)](on_device.seed, on_device.position, got, BLOCK=4096)
    expected = noise(row_keys(batch.seed, batch.position), tokens)[0]
    assert (got.cpu() - expected).abs().max() <= 4e-6
    assert expected.max() > 13  # uniforms within 2**-19 of 1 among them
