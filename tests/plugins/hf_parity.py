"""A tiny random model through xinfer against transformers' modeling code (fp32, CPU): logits
at every prompt position, greedy tokens, and the log-probability of each generated token."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import prefill_logits, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.loading.weights import MissingWeightsError

NEW_TOKENS = 24


def randomize(model: torch.nn.Module, names: tuple[str, ...] = ("norm.weight", ".bias"), seed: int = 1) -> None:
    """Norm weights and biases away from HF's initial ones and zeros (biases on the scale of the
    weights, so they do not drown the tokens), so that a norm or bias loaded into the wrong place,
    or not applied, changes the output."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(names):
                initial, scale = (1.0, 0.5) if name.endswith("norm.weight") else (0.0, 0.05)
                param.copy_(initial + scale * torch.randn(param.shape, generator=generator))


def assert_prefill_logits_match(hf: torch.nn.Module, llm: LLM, length: int) -> None:
    tokens = prompt(length)
    with torch.inference_mode():
        expected = hf(torch.tensor([tokens])).logits[0]
    got = prefill_logits(llm.engine, tokens)
    error = ((got - expected).abs().max(dim=-1).values / expected.abs().max(dim=-1).values).max()
    assert error <= 1e-4, f"max|diff|/max|HF logit| = {error:.2e} (worst position)"


def assert_greedy_tokens_and_logprobs_match(hf: torch.nn.Module, llm: LLM, length: int) -> None:
    tokens = prompt(length, seed=1)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    out = llm.generate([tokens], params)[0].outputs[0]
    assert out.logprobs is not None
    assert_output_matches_hf(hf, tokens, out, NEW_TOKENS)


def hf_greedy(hf: torch.nn.Module, tokens: list[int], new_tokens: int, **inputs) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of ``tokens`` and each chosen token's log-probability;
    ``inputs``: the model's other inputs (``pixel_values``, ``token_type_ids``...). Every prompt token is attended
    to: without a mask, ``generate`` would mask those equal to the config's ``pad_token_id``."""
    inputs.setdefault("attention_mask", torch.ones(1, len(tokens), dtype=torch.long))
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([tokens]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
            output_logits=True, return_dict_in_generate=True, **inputs,
        )  # fmt: skip
    new = out.sequences[0, len(tokens) :].tolist()
    return new, [torch.log_softmax(logits[0].float(), dim=-1)[t].item() for logits, t in zip(out.logits, new)]


def assert_output_matches_hf(
    hf: torch.nn.Module, tokens: list[int], output, new_tokens: int, atol: float = 1e-4, **inputs
):
    """``output`` (a greedy completion of ``tokens`` with logprobs) has transformers' tokens and log-probabilities
    (``inputs``: as :func:`hf_greedy`'s)."""
    expected_tokens, expected_logprobs = hf_greedy(hf, tokens, new_tokens, **inputs)
    assert output.token_ids == expected_tokens
    got = [step[token] for step, token in zip(output.logprobs, output.token_ids)]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected_logprobs), atol=atol, rtol=0)


def assert_prefix_hit_mid_prompt_matches_hf(
    hf: torch.nn.Module, llm: LLM, params: SamplingParams, atol: float = 1e-4
) -> None:
    """A prompt sharing two full blocks of 16 with an earlier one (diverging inside the third) hits those
    32 tokens and still gives transformers' tokens."""
    first = prompt(45, seed=3)
    second = first[:37] + prompt(11, seed=4)
    llm.generate([first], params)
    out = llm.generate([second], params)[0]
    assert out.num_cached_tokens == 32
    assert_output_matches_hf(hf, second, out.outputs[0], params.max_tokens, atol)


def assert_preempted_sequences_match_hf(
    hf: torch.nn.Module, llm: LLM, params: SamplingParams, atol: float = 1e-4
) -> None:
    """Two prompts of 3 and 4 blocks of 16 through ``llm``, whose pool of 7 blocks makes decoding preempt."""
    prompts = [prompt(44, seed=5), prompt(52, seed=6)]
    outputs = llm.generate(prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    for tokens, out in zip(prompts, outputs):
        assert_output_matches_hf(hf, tokens, out.outputs[0], params.max_tokens, atol)


def spread_routing(model: torch.nn.Module, seed: int = 2) -> None:
    """Router weights large enough, and correction biases random enough, that tokens go to many
    experts and the bias changes the choice (HF initializes the router small and the bias to 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("mlp.gate.weight"):
                tensor.copy_(0.3 * torch.randn(tensor.shape, generator=generator))
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))


def router_outputs(model: torch.nn.Module, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer of a transformers model, its router's logits [T, E] and chosen experts [T, k] on ``tokens``."""
    outputs: list[tuple[torch.Tensor, torch.Tensor]] = []
    routers = [module for name, module in model.named_modules() if name.endswith("mlp.gate")]
    hooks = [r.register_forward_hook(lambda _m, _i, out: outputs.append((out[0], out[2]))) for r in routers]
    try:
        with torch.inference_mode():
            model(torch.tensor([tokens]))
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def assert_missing_tensor_is_named(folder: Path, dropped: str, named: str) -> None:
    """Loading ``folder``'s checkpoint without its tensor ``dropped`` is one error naming ``named`` (the
    checkpoint's name where the model merges it into another weight; a module that loads its own, its part)."""
    tensors = load_file(folder / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(MissingWeightsError, match=re.escape(named)):
        LLM(model=str(folder), dtype="float32", num_blocks=64)


def randomized_model(config, folder: Path) -> tuple[torch.nn.Module, LLM]:
    """A tiny transformers model of ``config`` with its norms, biases and routers randomized
    (:func:`randomize`, :func:`spread_routing`), saved to ``folder``, and xinfer's LLM of it."""
    hf = save_tiny_model(config, folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, LLM(model=str(folder), dtype="float32", num_blocks=64)
