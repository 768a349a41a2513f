"""The torch reference sampler draws exactly the filtered softmax: frequencies over many
draws (a row per position, fixed seeds: the test's outcome is fixed) against the
distribution that transformers' warpers leave, applied in the order ``generate`` applies
them; a token outside the kept set is never drawn, and ties at a boundary are kept together."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from xinfer import ops
from xinfer.engine.sampler import Sampler
from xinfer.engine.sequence import Sequence
from xinfer.sampling import SampledRow, SamplingBatch, SamplingParams
from xinfer.torch_ops import TorchOps
from xinfer.torch_sampling import mix, sample

LOGITS = torch.tensor([3.1, 2.9, 2.5, 2.4, 2.0, 1.7, 1.5, 1.1, 0.8, 0.6, 0.2, -0.3, -0.9, -1.4, -2.2, -3.0])
DRAWS = 40_000


def filtered_softmax(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' temperature, top-k, top-p and min-p warpers, in ``generate``'s order."""
    warpers = [TemperatureLogitsWarper(p.temperature)]
    warpers += [TopKLogitsWarper(p.top_k)] if p.top_k else []
    warpers += [TopPLogitsWarper(p.top_p)] if p.top_p < 1 else []
    warpers += [MinPLogitsWarper(p.min_p)] if p.min_p else []
    scores, no_input = logits[None].double(), torch.zeros(1, 0, dtype=torch.long)
    for warper in warpers:
        scores = warper(no_input, scores)
    return torch.softmax(scores[0], 0)


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def draw(logits: torch.Tensor, params: SamplingParams, seed: int = 1234, n: int = DRAWS) -> torch.Tensor:
    batch = SamplingBatch.of([SampledRow(params, seed, position) for position in range(n)])
    return sample(logits.expand(n, -1), batch)


FILTERS = {
    "temperature": SamplingParams(temperature=1.0),
    "cold": SamplingParams(temperature=0.6),
    "top-k": SamplingParams(temperature=1.3, top_k=5),
    "top-p": SamplingParams(temperature=1.0, top_p=0.8),
    "min-p": SamplingParams(temperature=0.9, min_p=0.12),
    "all": SamplingParams(temperature=0.8, top_k=9, top_p=0.9, min_p=0.05),
    "top-p-small": SamplingParams(temperature=1.0, top_p=0.3),
}


@pytest.mark.parametrize("name", FILTERS)
def test_frequencies_follow_the_filtered_softmax(name):
    params = FILTERS[name]
    expected = filtered_softmax(LOGITS, params)
    counts = torch.bincount(draw(LOGITS, params), minlength=len(LOGITS)).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"drew tokens outside the kept set: {counts}"
    expected_counts = expected[kept] * DRAWS
    statistic = ((counts[kept] - expected_counts) ** 2 / expected_counts).sum().item()
    df = int(kept.sum()) - 1
    if df:
        assert statistic < chi_square_critical(df), (statistic, counts[kept], expected_counts)


def test_ties_at_a_boundary_are_kept_together():
    logits = torch.tensor([2.0, 1.0, 1.0, 1.0, 0.0, -1.0])
    tokens = draw(logits, SamplingParams(temperature=1.0, top_k=2), n=4000)
    assert set(tokens.tolist()) == {0, 1, 2, 3}
    # top-p: mass strictly above tokens 1..3 is token 0's, below 0.6: all three are kept
    tokens = draw(logits, SamplingParams(temperature=1.0, top_p=0.55), n=4000)
    assert set(tokens.tolist()) == {0, 1, 2, 3}


def test_a_temperature_below_vllm_s_floor_samples_at_it():
    """vLLM raises a temperature in (0, 0.01) to 0.01 (near 1e-39, 1 / T overflows float32); only 0 is greedy. Two
    tokens 0.003 apart in logits are drawn about 43 % / 57 % at 0.01, never the second at 1e-6 were it greedy."""
    logits = torch.tensor([0.0, 3.0, 3.003, -1.0])
    for temperature in (1e-6, 1e-30, 1e-39, 1e-44):
        params = SamplingParams(temperature=temperature)
        assert params.temperature == 0.01 and not params.greedy
        tokens = draw(logits, params, n=2000)
        assert set(tokens.tolist()) == {1, 2} and 0.35 < (tokens == 1).float().mean() < 0.51, temperature


def test_greedy_rows_and_a_row_s_draw_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 200) * 3
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=20, min_p=0.01), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0)]  # fmt: skip
    rows = [SampledRow(p, 100 + i, 7 * i) for i, p in enumerate(params)]
    together = sample(logits, SamplingBatch.of(rows))
    alone = [sample(logits[i : i + 1], SamplingBatch.of([row])).item() for i, row in enumerate(rows)]
    assert together.tolist() == alone
    assert together[1] == logits[1].argmax() and together[4] == logits[4].argmax()


def test_noise_hash_is_a_bijection_of_32_bit_words():
    words = torch.arange(1 << 16, dtype=torch.int64) * 65_537 % (1 << 32)
    assert mix(words).unique().numel() == words.numel()
    assert int(mix(torch.tensor([0xFFFFFFFF])).max()) < 1 << 32


def test_frequencies_with_penalties_and_bias_follow_transformers_processors():
    # the sampler's adjusted logits, drawn from: logit bias, repetition penalty (prompt and output), then
    # OpenAI's frequency and presence penalties (output), as transformers' and vLLM's processors apply them
    logits = LOGITS[:10]
    prompt, output = [0, 4], [1, 1, 2]
    bias, n = {3: 1.5, 0: -2.0, 4: 2.0}, 20_000  # 0 and 4 are in the prompt
    params = dict(temperature=0.8, top_k=7, repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.4)
    batch = [
        Sequence(f"s{i}", prompt + output, SamplingParams(**params, logit_bias=bias, seed=i), num_prompt_tokens=2)
        for i in range(n)
    ]
    with ops.use(TorchOps()):
        tokens = Sampler(torch.device("cpu"))(logits.expand(n, -1).clone(), batch).result().token_ids
    ids = torch.tensor([prompt + output])
    scores = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(ids, logits[None].clone())
    scores = RepetitionPenaltyLogitsProcessor(1.4)(ids, scores)[0]
    counts_out = torch.bincount(torch.tensor(output), minlength=len(logits)).float()
    scores = scores - 0.3 * counts_out - 0.4 * (counts_out > 0).float()
    expected = filtered_softmax(scores, SamplingParams(temperature=0.8, top_k=7))
    counts = torch.bincount(torch.tensor(tokens), minlength=len(logits)).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, counts
    expected_counts = expected[kept] * n
    statistic = ((counts[kept] - expected_counts) ** 2 / expected_counts).sum().item()
    assert statistic < chi_square_critical(int(kept.sum()) - 1), (statistic, counts[kept], expected_counts)
