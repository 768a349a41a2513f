"""The key equalizer: scores unchanged, energies balanced, smaller score error for
rotated low-bit keys where queries and keys load different channels, and the engine
calibrating it once per layer for formats that rotate keys."""

import pytest
import torch

from tests.tiny_models import COMMON, prompt
from xinfer import LLM, SamplingParams
from xinfer.cache.allocate import attention_layers
from xinfer.kv import get_format
from xinfer.kv.equalizer import divide_keys, equalizer, scale_queries


def channel_mismatched(tokens: int, kv_heads: int = 2, group: int = 3, head_dim: int = 64, seed: int = 0):
    """Queries and keys whose energy sits in different channels, as in real models."""
    g = torch.Generator().manual_seed(seed)
    k_gain = torch.ones(head_dim)
    k_gain[:8] = 20.0  # keys: a few loud channels
    q_gain = torch.ones(head_dim)
    q_gain[32:40] = 20.0  # queries: other ones
    k = torch.randn(tokens, kv_heads, head_dim, generator=g) * k_gain
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=g) * q_gain
    return q, k


def grouped_scores(q, k):
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    qg = q.view(tokens, kv_heads, heads // kv_heads, head_dim)
    return torch.einsum("tkgd,skd->kgts", qg.double(), k.double())


def test_scores_are_unchanged_and_energies_balanced():
    q, k = channel_mismatched(256)
    tokens, heads, head_dim = q.shape
    q_energy = q.view(tokens, 2, heads // 2, head_dim).pow(2).sum((0, 2))
    s = equalizer(q_energy, k.pow(2).sum(0))
    assert torch.allclose(s.log().mean(-1), torch.zeros(2), atol=1e-5)  # geometric mean 1
    exact = grouped_scores(q, k)
    equalized = grouped_scores(scale_queries(q, s), divide_keys(k, s))
    assert (equalized - exact).abs().max() <= 1e-5 * exact.abs().max()  # fp32 rounding of the scaling only
    k_after = divide_keys(k, s).pow(2).sum(0)
    q_after = scale_queries(q, s).view(tokens, 2, heads // 2, head_dim).pow(2).sum((0, 2))
    ratio = k_after / q_after
    assert (ratio / ratio.mean(-1, keepdim=True) - 1).abs().max() < 1e-4  # the same in every channel


@pytest.mark.parametrize("name", ["turbo4", "turbo3"])
def test_equalizer_cuts_the_score_error_of_rotated_keys(name):
    fmt = get_format(name)
    q, k = channel_mismatched(512)
    tokens, heads, head_dim = q.shape
    s = equalizer(q.view(tokens, 2, heads // 2, head_dim).pow(2).sum((0, 2)), k.pow(2).sum(0))
    exact = grouped_scores(q, k)
    errors = {}
    for label, eq in (("plain", None), ("equalized", s)):
        stored = fmt.quantize(k, k, torch.float32, eq)
        keys, _ = fmt.dequantize(stored, eq)
        errors[label] = ((grouped_scores(q, keys) - exact).norm() / exact.norm()).item()
    assert errors["equalized"] < 0.7 * errors["plain"], errors


def test_engine_calibrates_rotated_formats_only(model_dir):
    rotated = LLM(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype="turbo4")
    layers = attention_layers(rotated.engine.model)
    assert len(layers) == COMMON["num_hidden_layers"]  # each of them checked
    for layer in layers:
        s = layer.cache.equalizer
        assert s.shape == (layer.num_kv_heads, layer.head_dim)
        assert torch.isfinite(s).all() and (s > 0).all()
    again = LLM(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype="turbo4")
    for a, b in zip(attention_layers(rotated.engine.model), attention_layers(again.engine.model)):
        assert torch.equal(a.cache.equalizer, b.cache.equalizer)  # deterministic
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert len(rotated.generate([prompt(20, seed=1)], params)[0].outputs[0].token_ids) == 8
    fp8 = LLM(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype="fp8")  # rotates its keys
    assert all(layer.cache.equalizer is not None for layer in attention_layers(fp8.engine.model))
    auto = LLM(model=model_dir, dtype="float32", num_blocks=64)
    assert all(layer.cache.equalizer is None for layer in attention_layers(auto.engine.model))


def test_calibration_does_not_depend_on_the_engines_limits(model_dir):
    # else engines that differ only in them store other codes, and greedy tokens differ
    options = dict(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype="turbo4")
    default = attention_layers(LLM(**options).engine.model)
    limited = attention_layers(LLM(**options, max_model_len=48, max_num_batched_tokens=16).engine.model)
    for a, b in zip(default, limited, strict=True):
        assert torch.equal(a.cache.equalizer, b.cache.equalizer)
        assert torch.equal(a.cache.key_offset, b.cache.key_offset)
