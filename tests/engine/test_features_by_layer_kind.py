"""The engine's features on each kind of layer, against transformers run prompt by prompt (fp32, CPU):
sliding windows shorter than the prompts (Mistral, Gemma 3), Gemma 4's head dims per layer type, latent
attention (DeepSeek V3, and V3.2 selecting 8 positions), Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next),
experts (Qwen3-MoE) and LongRoPE's switch to its long factors (Phi-3.5). Per kind: prompts of very different
lengths in one call, prefilled in chunks beside decoding rows and preempted; a prefix-cache hit; seeded
choices; penalties and ``min_tokens`` against a hand computation on transformers' logits. Each suite's own
tests cover one prompt at a time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from transformers import MistralConfig, PretrainedConfig

from tests.plugins.deepseek.configs import deepseek_v3_config
from tests.plugins.deepseek.test_deepseek_v32 import deepseek_v32_config
from tests.plugins.gemma.test_gemma4 import gemma4_config, randomize_gemma4
from tests.plugins.hf_parity import hf_greedy, randomize, spread_routing
from tests.plugins.qwen.test_qwen3_next import CONFIGS as HYBRIDS
from tests.plugins.qwen.test_qwen3_next import randomize_hybrid
from tests.plugins.qwen.test_qwen_moe import CONFIGS as MOES
from tests.tiny_models import COMMON, gemma3_config, phi3_longrope_config, prompt, save_tiny_model
from xinfer import LLM, SamplingParams


def randomize_all(model: torch.nn.Module) -> None:
    randomize(model)
    spread_routing(model)


def randomize_hybrid_and_routers(model: torch.nn.Module) -> None:
    randomize_hybrid(model)
    spread_routing(model)


KINDS: dict[str, tuple[Callable[[], PretrainedConfig], Callable[[torch.nn.Module], None]]] = {
    "mistral-window-16": (
        lambda: MistralConfig(**COMMON, sliding_window=16, tie_word_embeddings=False,
                              architectures=["MistralForCausalLM"]),
        randomize_all,
    ),
    "gemma3-window-16": (gemma3_config, randomize_all),
    "gemma4-head-dims": (gemma4_config, randomize_gemma4),
    "deepseek-v3": (deepseek_v3_config, randomize_all),
    "deepseek-v32-topk-8": (deepseek_v32_config, randomize_all),
    "qwen3.5": (HYBRIDS["qwen3.5"], randomize_hybrid_and_routers),
    "qwen3-next": (HYBRIDS["qwen3-next"], randomize_hybrid_and_routers),
    "qwen3-moe": (MOES["qwen3-moe"], randomize_all),
    # trained at 32 positions: a longer sequence is computed with the long factors, its first step past 32
    "phi3-longrope": (phi3_longrope_config, randomize_all),
}  # fmt: skip
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=sorted(KINDS))
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    config, randomizer = KINDS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_model(config(), folder)
    randomizer(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, str(folder)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(model=checkpoint[1], dtype="float32", num_blocks=64, max_num_batched_tokens=32)


def hf_log_softmax(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [T, vocab] after each prefix of ``tokens``."""
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float().log_softmax(-1)


def assert_logprob_entries_match(entries, chosen: list[int], expected: torch.Tensor, top_n: int = 1) -> None:
    """Each entry holds its chosen token and the ``top_n`` likeliest, at transformers' log-probabilities."""
    for entry, token, row in zip(entries, chosen, expected, strict=True):
        top = row.topk(top_n)
        assert set(entry) == {token, *top.indices.tolist()}
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        for alternative, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[alternative] == pytest.approx(value, abs=1e-4)


def test_prompts_of_different_lengths_chunked_and_preempted_match_hf_alone(checkpoint):
    """Prompts of 3 to 61 tokens in one call, through 16-token steps (the short ones decode while the long
    ones prefill) and a pool of 5 blocks that makes some wait and recompute: each prompt's tokens and
    log-probabilities (and the likeliest alternative) are transformers' for that prompt alone."""
    hf, folder = checkpoint
    small = LLM(model=folder, dtype="float32", num_blocks=5, max_model_len=80, max_num_batched_tokens=16)
    prompts = [prompt(length, seed=2) for length in (3, 61, 17, 40)]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    outputs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    for tokens, out in zip(prompts, outputs):
        choice = out.outputs[0]
        assert choice.token_ids == hf_greedy(hf, tokens, NEW_TOKENS)[0]
        expected = hf_log_softmax(hf, tokens + choice.token_ids)[len(tokens) - 1 : -1]
        assert choice.logprobs is not None
        assert_logprob_entries_match(choice.logprobs, choice.token_ids, expected)


def test_a_prefix_hit_gives_hf_tokens_and_prompt_logprobs(checkpoint, llm):
    """A second call whose prompts share 50 and 40 tokens with the first's hits the prefix cache (on the
    hybrids, where a state snapshot was taken: the first prompt's last block boundary), and its tokens and
    prompt log-probabilities are transformers' (a cold run)."""
    hf, _ = checkpoint
    shared = prompt(50, seed=7)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    llm.generate([shared + prompt(6, seed=8)], params)
    hits = llm.engine.stats().prefix_cache_hits
    second = [shared + prompt(9, seed=9), shared[:40] + prompt(5, seed=10)]
    outputs = llm.generate(second, params)
    assert outputs[0].num_cached_tokens == 48 and llm.engine.stats().prefix_cache_hits > hits
    for tokens, out in zip(second, outputs):
        assert out.outputs[0].token_ids == hf_greedy(hf, tokens, 6)[0]
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        assert_logprob_entries_match(out.prompt_logprobs[1:], tokens[1:], hf_log_softmax(hf, tokens)[:-1])
    llm.reset_prefix_cache()  # every block and state snapshot forgotten: the same prompts run cold, as before
    again = llm.generate(second, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert again[0].num_cached_tokens == 0  # (the second prompt may hit the first's blocks of this call)
    assert [out.outputs[0].token_ids for out in again] == [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("checkpoint", ["mistral-window-16"], indirect=True)
def test_prompt_logprobs_of_a_prompt_longer_than_a_sliding_pool(checkpoint):
    """A 200-token prompt's log-probabilities where the window's pool holds 96 tokens: scored in steps of
    ``max_num_batched_tokens``, as its prefill runs, not all at once (which would not fit)."""
    hf, folder = checkpoint
    small = LLM(model=folder, dtype="float32", num_blocks=6, max_model_len=256, max_num_batched_tokens=16)
    tokens = prompt(200, seed=3)
    out = small.generate([tokens], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert_logprob_entries_match(out.prompt_logprobs[1:], tokens[1:], hf_log_softmax(hf, tokens)[:-1], top_n=2)


def test_seeded_choices_draw_alone_what_they_draw_in_a_batch(llm):
    """Choice i of a request with ``n`` 3 and seed s draws what a request of its own with seed s + i
    draws, alone and beside other requests."""
    tokens = prompt(23, seed=11)
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=NEW_TOKENS, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate([tokens], params)[0].outputs]
    others = [SamplingParams(temperature=0.8, seed=1, max_tokens=5), SamplingParams(temperature=0, max_tokens=9)]
    batch = llm.generate([prompt(50, seed=12), tokens, prompt(4, seed=13)], [others[0], params, others[1]])
    assert [c.token_ids for c in batch[1].outputs] == alone
    for i, choice in enumerate(alone):
        single = SamplingParams(temperature=1.0, seed=5 + i, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert llm.generate([tokens], single)[0].outputs[0].token_ids == choice
    assert len({tuple(c) for c in alone}) > 1


def hf_greedy_adjusted(
    hf: torch.nn.Module, tokens: list[int], count: int, adjust: Callable[[torch.Tensor, list[int], list[int]], None]
) -> list[int]:
    """Greedy tokens from transformers' logits changed in place by ``adjust(logits, context, output)``."""
    context, output = list(tokens), []
    for _ in range(count):
        with torch.inference_mode():
            logits = hf(torch.tensor([context])).logits[0, -1]
        logits = logits.float().clone()  # outside inference mode: a tensor ``adjust`` may change
        adjust(logits, context, output)
        output.append(int(logits.argmax()))
        context.append(output[-1])
    return output


def test_penalties_and_min_tokens_follow_a_hand_computation_on_hf_logits(checkpoint, llm):
    """Repetition (HF's, over prompt and output), presence and frequency penalties (OpenAI's, over the
    output), and ``min_tokens`` holding back a stop token, in one batch: each row's tokens are the argmax
    of transformers' logits so adjusted."""
    hf, _ = checkpoint
    generator = torch.Generator().manual_seed(17)
    seen = torch.randperm(COMMON["vocab_size"], generator=generator)[:120].tolist()  # often what greedy picks
    penalties = dict(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=1.5)

    def penalize(logits: torch.Tensor, context: list[int], output: list[int]) -> None:
        used = torch.tensor(sorted(set(context)))
        logits[used] = torch.where(logits[used] > 0, logits[used] / 1.5, logits[used] * 1.5)
        for token, count in Counter(output).items():
            logits[token] -= 1.5 * count + 1.0

    held = prompt(25, seed=16)
    stop = hf_greedy(hf, held, 1)[0][0]

    def hold_stop(logits: torch.Tensor, _context: list[int], output: list[int]) -> None:
        if len(output) < 4:
            logits[stop] = float("-inf")

    expected_penalized = hf_greedy_adjusted(hf, seen, 12, penalize)
    assert expected_penalized != hf_greedy(hf, seen, 12)[0]  # the penalties change the choice
    expected_held = hf_greedy_adjusted(hf, held, NEW_TOKENS, hold_stop)
    if stop in expected_held:
        expected_held = expected_held[: expected_held.index(stop) + 1]
    outputs = llm.generate(
        [seen, held, prompt(9, seed=2)],
        [
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **penalties),
            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, stop_token_ids=[stop], min_tokens=4),
            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        ],
    )
    assert outputs[0].outputs[0].token_ids == expected_penalized
    assert outputs[1].outputs[0].token_ids == expected_held
