"""KV pool and max_num_seqs planning: the arithmetic on fake numbers, and the whole
measuring path on the CPU through a fake device memory."""

import logging

import pytest
import torch
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.cache.allocate import attention_layers, bytes_per_block
from xinfer.engine import build as build_module
from xinfer.engine import memory_plan
from xinfer.engine.memory_plan import (
    DEFAULT_MAX_NUM_SEQS,
    MAX_NUM_SEQS_CAP,
    DeviceProfile,
    GiB,
    derive_max_num_seqs,
    kv_budget,
    profile_batch,
)
from xinfer.kv import get_format

H200 = dict(total=140 * GiB, free_at_start=139 * GiB)


def test_kv_gets_the_fraction_of_total_memory_less_what_the_engine_needs():
    profile = DeviceProfile(**H200, weights=15 * GiB, other=1 * GiB, activations=3 * GiB, graphs=GiB // 2)
    assert kv_budget(profile, 0.9) == int(140 * GiB * 0.9) - int(19.5 * GiB)
    assert kv_budget(profile, 0.5) == 70 * GiB - int(19.5 * GiB)


def test_weights_and_activations_beyond_the_budget_are_one_clear_line():
    profile = DeviceProfile(**H200, weights=60 * GiB, other=1 * GiB, activations=10 * GiB, graphs=GiB)
    with pytest.raises(ValueError) as error:
        kv_budget(profile, 0.5)
    message = str(error.value)
    assert "\n" not in message
    for part in (
        "weights 60.00 GiB",
        "activation peak 10.00 GiB",
        "CUDA graphs 1.00 GiB",
        "other 1.00 GiB",
        "72.00 GiB",
        "kv_fraction 0.5",
        "70.00 GiB",
        "--kv-fraction",
    ):
        assert part in message, part


def test_a_fraction_beyond_the_free_memory_is_refused():
    profile = DeviceProfile(total=80 * GiB, free_at_start=40 * GiB, weights=GiB, other=0, activations=0, graphs=0)
    with pytest.raises(ValueError, match=r"asks for 72.00 GiB .* only 40.00 GiB were free .*--kv-fraction"):
        kv_budget(profile, 0.9)
    assert kv_budget(profile, 0.45) == 35 * GiB


@pytest.mark.parametrize(
    "capacity, max_model_len, expected",
    [
        (10_000_000, 131072, MAX_NUM_SEQS_CAP),  # a large pool: the cap
        (64 * 1024, 131072, 64),  # 1024 tokens each
        (64 * 1024, 256, 256),  # a short context: sequences are shorter
        (4 * 1024 * 1024, 256, MAX_NUM_SEQS_CAP),
        (20 * 256, 256, 20),
        (500, 8192, 1),  # never none
    ],
)
def test_max_num_seqs_follows_the_kv_capacity(capacity, max_model_len, expected):
    assert derive_max_num_seqs(capacity, max_model_len) == expected


def test_profile_batch_splits_at_the_context_limit_and_writes_no_kv():
    batch = profile_batch(100, max_model_len=32, block_size=16)
    assert batch.seq_lens == [32, 32, 32, 4]
    assert batch.cu_seqlens_q == [0, 32, 64, 96, 100]
    assert len(batch.input_ids) == len(batch.positions) == 100
    assert batch.positions[32:35] == [0, 1, 2]
    assert set(batch.pages[0].slot_mapping) == {-1}
    assert [len(row) for row in batch.pages[0].block_tables] == [2, 2, 2, 1]
    assert profile_batch(64, max_model_len=64, block_size=16).seq_lens == [64]


class FakeMemory:
    """A device of ``total`` bytes whose free memory and peak are what the test says."""

    def __init__(self, total: int, free: int, peak: int):
        self.total, self.free, self.peak_bytes = total, free, peak
        self.calls: list[str] = []

    def info(self) -> tuple[int, int]:
        self.calls.append("info")
        return self.free, self.total

    def allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def peak(self) -> int:
        self.calls.append("peak")
        return self.peak_bytes

    def release_cached(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    return str(folder)


def weight_bytes(engine) -> int:
    return sum(t.numel() * t.element_size() for t in [*engine.model.parameters(), *engine.model.buffers()])


def test_measured_plan_sizes_the_pool_and_max_num_seqs(model_dir, monkeypatch, caplog):
    """The profiling forward runs (here on the CPU) and the pool gets total x fraction
    less the weights and the measured peak; max_num_seqs follows the pool."""
    fake = FakeMemory(total=4 << 20, free=4 << 20, peak=512 << 10)
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: fake)
    with caplog.at_level(logging.INFO, logger="xinfer"):
        llm = LLM(model=model_dir, dtype="float32", kv_fraction=0.5, max_num_batched_tokens=300, max_model_len=128)
    engine = llm.engine
    budget = (2 << 20) - weight_bytes(engine) - (512 << 10)
    num_blocks = engine.cache.pools[0].num_blocks
    assert num_blocks == budget // bytes_per_block(engine.model, 16, engine.dtype, engine.kv_format)
    max_num_seqs = engine.config.scheduler.max_num_seqs
    assert 1 < max_num_seqs == derive_max_num_seqs(num_blocks * 16, 128) < MAX_NUM_SEQS_CAP
    assert engine.scheduler.config.max_num_seqs == max_num_seqs
    assert fake.calls.index("reset_peak") < fake.calls.index("peak")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    for part in (
        "kv_fraction 0.5 of 0.00 GiB",
        "activation peak 0.00 GiB",
        "CUDA graph reserve 0.00 GiB",
        f"{num_blocks * 16} tokens",
        f"max_num_seqs {max_num_seqs} (derived)",
    ):
        assert part in line, (part, line)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLM(model=model_dir, dtype="float32", num_blocks=64, max_model_len=128)
    assert (
        llm.generate([prompt(20)], params)[0].outputs[0].token_ids
        == reference.generate([prompt(20)], params)[0].outputs[0].token_ids
    )


def test_max_num_seqs_given_is_kept(model_dir, monkeypatch):
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: FakeMemory(4 << 20, 4 << 20, 0))
    llm = LLM(model=model_dir, dtype="float32", kv_fraction=0.5, max_model_len=128, max_num_seqs=3)
    assert llm.engine.config.scheduler.max_num_seqs == 3


def test_a_pool_sized_by_hand_keeps_the_usual_max_num_seqs(model_dir):
    llm = LLM(model=model_dir, dtype="float32", num_blocks=8, max_model_len=128)
    assert llm.engine.config.scheduler.max_num_seqs == DEFAULT_MAX_NUM_SEQS


def test_no_room_left_fails_at_start_up(model_dir, monkeypatch):
    fake = FakeMemory(total=1 << 30, free=1 << 30, peak=1 << 30)
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: fake)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        LLM(model=model_dir, dtype="float32", max_model_len=128)


def test_too_small_a_pool_for_the_context_names_the_flags(model_dir):
    expected = r"holds 64 tokens .* max_model_len=128: lower max_model_len \(--max-model-len\)"
    with pytest.raises(ValueError, match=expected):
        LLM(model=model_dir, dtype="float32", num_blocks=4, max_model_len=128)


def test_the_profiled_cache_has_the_real_caches_key_transforms(model_dir, monkeypatch):
    """The plan's one-block cache (which the step graphs are captured over) carries the
    key offset and equalizer the real cache gets, so both captures compile the same
    kernel variants."""
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: FakeMemory(4 << 20, 4 << 20, 0))
    profiled = []
    measure = memory_plan.peak_activations

    def spy(runner, *args):
        profiled.extend(layer.cache for layer in attention_layers(runner.model))
        return measure(runner, *args)

    monkeypatch.setattr(memory_plan, "peak_activations", spy)
    llm = LLM(model=model_dir, dtype="float32", kv_fraction=0.5, max_model_len=128, kv_cache_dtype="turbo4")
    real = [layer.cache for layer in attention_layers(llm.engine.model)]
    assert len(profiled) == len(real) > 0
    for one_block, cache in zip(profiled, real):
        assert one_block["k"].shape[0] == 1 < cache["k"].shape[0]
        assert cache.equalizer is not None and torch.equal(one_block.equalizer, cache.equalizer)
        assert cache.key_offset is not None and torch.equal(one_block.key_offset, cache.key_offset)


def test_recent_window_shadows_come_out_of_the_planned_pool(model_dir, monkeypatch, caplog):
    fake = FakeMemory(total=4 << 20, free=4 << 20, peak=512 << 10)
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: fake)
    options = dict(dtype="float32", kv_fraction=0.5, max_num_batched_tokens=64, max_model_len=128, max_num_seqs=4,
                   kv_cache_dtype="turbo4")  # fmt: skip
    plain = LLM(model=model_dir, **options).engine
    with caplog.at_level(logging.INFO, logger="xinfer"):
        windowed = LLM(model=model_dir, kv_recent_window=32, **options).engine
    shadows = memory_plan.shadow_blocks(4, 64, 32, 16)
    assert shadows == 4 * (2 + 3) + 4 == len(windowed.cache.pools[0].recent_window.free)
    exact_block = bytes_per_block(windowed.model, 16, windowed.dtype, get_format("auto"))
    quantized_block = bytes_per_block(windowed.model, 16, windowed.dtype, windowed.kv_format)
    taken = -(-shadows * exact_block // quantized_block)
    assert windowed.cache.pools[0].num_blocks == plain.cache.pools[0].num_blocks - taken
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    assert f"recent-window shadows {shadows * exact_block / GiB:.2f} GiB ({shadows} blocks)" in line


def test_derived_max_num_seqs_leaves_their_tokens_beside_their_shadows(model_dir, monkeypatch):
    """Each sequence the planner counts on gets its tokens (the context limit, if
    shorter than 1024) in the pool left once the shadows of that many are out of it."""
    fake = FakeMemory(total=8 << 20, free=8 << 20, peak=512 << 10)
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: fake)
    options = dict(
        dtype="float32", kv_fraction=0.5, max_num_batched_tokens=64, max_model_len=128, kv_cache_dtype="turbo4"
    )
    plain = LLM(model=model_dir, **options).engine
    windowed = LLM(model=model_dir, kv_recent_window=64, **options).engine
    seqs = windowed.config.scheduler.max_num_seqs
    assert seqs < plain.config.scheduler.max_num_seqs < MAX_NUM_SEQS_CAP
    assert windowed.cache.pools[0].num_blocks * 16 >= seqs * 128
    assert len(windowed.cache.pools[0].recent_window.free) == memory_plan.shadow_blocks(seqs, 64, 64, 16)


def test_no_room_beside_the_shadows_names_the_window(model_dir, monkeypatch):
    fake = FakeMemory(total=4 << 20, free=4 << 20, peak=512 << 10)
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: fake)
    with pytest.raises(
        ValueError,
        match=r"holds 0 tokens \(0 blocks of 16\) beside the recent window's \d+ exact "
        r"blocks \(a smaller --kv-recent-window or --prefill-chunk-size",
    ):
        LLM(model=model_dir, dtype="float32", kv_fraction=0.5, max_model_len=128, kv_cache_dtype="turbo4",
            kv_recent_window=64)  # fmt: skip
