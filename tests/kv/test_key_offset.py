"""The key offset: attention over keys stored less a constant vector is the same
attention; for keys with a large mean it cuts the rotated formats' error; the engine
calibrates it for every format that rotates keys, and never under a logit softcap."""

from dataclasses import replace

import pytest
import torch

from tests.tiny_models import COMMON
from xinfer import LLM
from xinfer.cache.allocate import attention_layers
from xinfer.engine.kv_calibration import KeyStatistics
from xinfer.kv import get_format
from xinfer.ops import AttentionMetadata
from xinfer_cpu.ops import CpuOps

CPU = CpuOps()


def keys_with_a_mean(tokens: int, kv_heads: int = 2, head_dim: int = 64, seed: int = 0) -> torch.Tensor:
    """Keys whose few loud channels sit far from zero, as in real models."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g)
    k[..., :4] += 12.0 * torch.randn(kv_heads, 4, generator=g).sign()
    return k


def two_sequences(seq_lens: list[int], q_lens: list[int], block_size: int = 8):
    tables, slots, used = [], [], 0
    for n in seq_lens:
        blocks = list(range(used, used + -(-n // block_size)))
        used += len(blocks)
        tables.append(blocks + [0] * (8 - len(blocks)))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    meta = AttentionMetadata(
        torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(tables, dtype=torch.int32), torch.full((sum(q_lens),), -1), max(q_lens), max(seq_lens),
    )  # fmt: skip
    return meta, torch.tensor(slots), used


def attend(fmt: str, k, v, q, meta, slots, num_blocks, key_offset=None, **kwargs) -> torch.Tensor:
    cache = get_format(fmt).allocate(num_blocks, 8, k.shape[1], k.shape[2], torch.float32, torch.device("cpu"))
    cache.key_offset = key_offset
    CPU.write_kv(k, v, cache, slots)
    return CPU.attend(q, cache, meta, k.shape[-1] ** -0.5, **kwargs)


@pytest.mark.parametrize("window", [None, 5])
def test_offset_leaves_attention_unchanged(window):
    meta, slots, num_blocks = two_sequences([19, 11], [6, 1])
    k = keys_with_a_mean(30)
    v = torch.randn(30, 2, 64)
    q = torch.randn(7, 6, 64)  # GQA: 3 query heads per KV head
    exact = attend("auto", k, v, q, meta, slots, num_blocks, window=window)
    shifted = attend("auto", k, v, q, meta, slots, num_blocks, key_offset=torch.randn(2, 64) * 10, window=window)
    torch.testing.assert_close(shifted, exact, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["turbo4", "turbo3"])
def test_offset_cuts_the_error_of_keys_with_a_mean(fmt):
    meta, slots, num_blocks = two_sequences([40, 24], [40, 24])
    k = keys_with_a_mean(64)
    v = torch.randn(64, 2, 64)
    q = torch.randn(64, 4, 64) * 3  # sharp attention, as trained models have
    exact = attend("auto", k, v, q, meta, slots, num_blocks)
    errors = {}
    for label, offset in (("plain", None), ("offset", k.mean(0))):
        out = attend(fmt, k, v, q, meta, slots, num_blocks, key_offset=offset)
        errors[label] = ((out - exact).norm() / exact.norm()).item()
    assert errors["offset"] < 0.7 * errors["plain"], errors


def test_softcapped_caches_are_marked():
    meta, slots, num_blocks = two_sequences([9], [9])
    cache = get_format("auto").allocate(num_blocks, 8, 2, 64, torch.float32, torch.device("cpu"))
    stats = KeyStatistics(CPU)
    k, v, meta = torch.randn(9, 2, 64), torch.randn(9, 2, 64), replace(meta, slot_mapping=slots)
    stats.attention(torch.randn(9, 4, 64), k, v, cache, meta, 0.125)
    assert id(cache) not in stats.softcapped
    stats.attention(torch.randn(9, 4, 64), k, v, cache, meta, 0.125, softcap=30.0)
    assert id(cache) in stats.softcapped


def test_engine_calibrates_offsets_of_rotated_keys(model_dir):
    for name in ("fp8", "turbo8", "turbo4", "turbo3"):
        llm = LLM(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype=name)
        layers = attention_layers(llm.engine.model)
        assert len(layers) == COMMON["num_hidden_layers"]  # each of them checked
        for layer in layers:
            c = layer.cache.key_offset
            assert c.shape == (layer.num_kv_heads, layer.head_dim) and torch.isfinite(c).all()
            assert c.abs().sum() > 0
    llm = LLM(model=model_dir, dtype="float32", num_blocks=64, kv_cache_dtype="auto")
    assert all(layer.cache.key_offset is None for layer in attention_layers(llm.engine.model))
