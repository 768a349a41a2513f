"""KV pool and max_num_seqs planning: the arithmetic on fake numbers, and the whole
measuring path on the CPU through a fake device memory."""

import logging
import math
import threading
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from tests.loading.test_gguf import write_gguf
from tests.quant.test_fp4_formats import write_checkpoint as write_fp4_checkpoint
from tests.quant.test_fp8_format import BLOCKS_128
from tests.quant.test_fp8_format import WIDE as FP8_WIDE
from tests.quant.test_int4_checkpoints import CASES as INT4_CASES
from tests.quant.test_int4_checkpoints import write_int4_checkpoint
from tests.quant.test_isq_at_load import held_as
from tests.quant.test_quantized_checkpoint import (
    BLOCKS,
    ROWS,
    packed_integer_scheme,
    write_fp8_checkpoint,
    write_packed_integer_checkpoint,
)
from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams
from xinfer.cache.allocate import attention_layers, bytes_per_block
from xinfer.config import EngineConfig
from xinfer.engine import build as build_module
from xinfer.engine import memory_plan
from xinfer.engine.memory_plan import (
    DEFAULT_MAX_NUM_SEQS,
    MAX_NUM_SEQS_CAP,
    DeviceProfile,
    GiB,
    check_fits,
    derive_max_num_seqs,
    kv_budget,
    profile_batch,
)
from xinfer.kv import get_format
from xinfer.loading import loader
from xinfer.loading.loader import held_model, load_config, load_model
from xinfer.quant import QuantizedTensor

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


# -- the fit check of a GGUF file: its weights counted as they are held -------------------------

T = gguf.GGMLQuantizationType
# llama.cpp's blocks (ggml-common.h: block_q4_K, block_q6_K): values per block, bytes per block
LLAMA_CPP_BLOCKS = {T.Q4_K: (256, 144), T.Q6_K: (256, 210)}
# every row a whole 256-value block; the embedding tied to the LM head (its rows are looked up)
Q4_K_M_CONFIG = dict(COMMON, hidden_size=256, intermediate_size=256, head_dim=64, tie_word_embeddings=True,
                     bos_token_id=1, eos_token_id=2)  # fmt: skip


def q4_k_m(hf_name: str) -> gguf.GGMLQuantizationType:
    """As llama.cpp's Q4_K_M mix: matrices Q4_K but v and down Q6_K, vectors F32."""
    if "norm" in hf_name:
        return T.F32
    return T.Q6_K if any(p in hf_name for p in ("v_proj", "down_proj")) else T.Q4_K


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """A tiny Llama as a Q4_K_M-like GGUF, and its weights' bytes: as the file stores them (llama.cpp's blocks),
    as the CPU backend holds them and in float32; and the KV cache of one 512-token sequence (fp32).

    The CPU backend repacks a linear's Q4_K for torch's int4 matmul (``_convert_weight_to_int4pack_for_cpu``: K / 2
    bytes of nibbles a row and a bf16 scale and zero per 32 values, 20 bytes per 32 values; every row count a
    multiple of 16 here) and its Q6_K into two int4 codes a value for the same matmul (twice K: 320 bytes per 256
    values); the tied embedding too (its rows are read back from that layout)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**Q4_K_M_CONFIG)).float()
    path = tmp_path_factory.mktemp("q4_k_m") / "tiny-Q4_K_M.gguf"
    write_gguf(model, "llama", path, storage=q4_k_m)
    rotary = 512 * 64 * 4  # the model's cos/sin buffer of each position (fp32)
    file_bytes, cpu_bytes, float_bytes = rotary, rotary, rotary
    for name, tensor in model.named_parameters():  # the tied LM head once
        qtype, n = q4_k_m(name), tensor.numel()
        float_bytes += 4 * n
        if qtype == T.F32:
            file_bytes, cpu_bytes = file_bytes + 4 * n, cpu_bytes + 4 * n
            continue
        values, size = LLAMA_CPP_BLOCKS[qtype]
        file_bytes += n // values * size
        cpu_bytes += n // 32 * 20 if qtype == T.Q4_K else n // 256 * 320
    kv = 2 * COMMON["num_hidden_layers"] * COMMON["num_key_value_heads"] * 64 * 512 * 4
    return path, file_bytes, cpu_bytes, float_bytes, kv


def mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.2f} MiB"


def gguf_fit_check(path, available: int) -> None:
    model = held_model(path, load_config(path), torch.float32, "auto")
    config = EngineConfig.from_kwargs(model=str(path), dtype="float32", device="cpu")
    check_fits(model, config, 512, torch.float32, available, "the device's memory", True)


def test_a_gguf_file_is_counted_at_its_tensors_bytes(q4_k_m_gguf):
    """Its Q4_K and Q6_K matrices at llama.cpp's bytes per block, read from the header (a 24 GB GPU took a
    Qwen2.5-14B Q4_K_M for 27.5 GiB of bf16): it fits where they fit, though its float32 size does not."""
    path, file_bytes, _, float_bytes, kv = q4_k_m_gguf
    assert float_bytes + kv > file_bytes + kv
    gguf_fit_check(path, file_bytes + kv)
    with pytest.raises(ValueError) as error:
        gguf_fit_check(path, file_bytes + kv - 1)
    assert str(error.value).startswith(
        f"the model does not fit in the device's memory: its weights take {mib(file_bytes)} packed "
        f"({mib(float_bytes)} in float32) and the KV cache of one 512-token sequence {mib(kv)}, "
        f"{mib(file_bytes + kv)} in all, and {mib(file_bytes + kv - 1)} are available: "
    )


def test_a_gguf_file_fits_as_the_backend_holds_its_weights_and_holds_what_was_counted(q4_k_m_gguf, monkeypatch):
    """Through LLM on the CPU backend, which repacks the file's blocks (see the fixture): refused one byte short
    of its repacked weights and the KV cache, before any weight is read; loaded with exactly that, its weights
    then taking what was counted."""
    path, _, cpu_bytes, float_bytes, kv = q4_k_m_gguf
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: cpu_bytes + kv - 1)
    with pytest.raises(ValueError) as error:
        LLM(model=str(path), dtype="float32", num_blocks=64)
    assert str(error.value).startswith(f"the model does not fit in cpu's memory: its weights take {mib(cpu_bytes)} "
                                       f"packed ({mib(float_bytes)} in float32)")  # fmt: skip
    assert "a smaller quantization of it" in str(error.value) and "--isq" not in str(error.value)  # packed already
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: cpu_bytes + kv)
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    assert weight_bytes(llm.engine) == cpu_bytes


# -- the fit check of a checkpoint stored quantized, kept packed ---------------------------------


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A tiny Llama whose projections are stored FP8 in blocks of 128 x 128 (DeepSeek's layout), and its weights'
    bytes: as loading keeps them (FP8 packed, the CPU backend having no repack of its own: each row's 128 e4m3
    codes of a block after the block's float32 scale) and in float32; and the KV cache of one 512-token sequence."""
    folder = tmp_path_factory.mktemp("fp8")
    config = LlamaConfig(**FP8_WIDE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    write_fp8_checkpoint(save_tiny_model(config, folder / "float"), folder, BLOCKS_128)
    rotary = 512 * 32 * 4  # the model's cos/sin buffer of each position (fp32; heads of 32)
    held = float_bytes = rotary
    with safe_open(folder / "model.safetensors", "pt") as file:
        for name in file.keys():  # noqa: SIM118
            stored = file.get_slice(name)
            values = math.prod(stored.get_shape())
            if name.endswith("weight_scale_inv"):
                continue  # the block scales: packed one a row's 128 values instead
            float_bytes += 4 * values
            held += values + values // 128 * 4 if stored.get_dtype() == "F8_E4M3" else 4 * values
    kv = 2 * COMMON["num_hidden_layers"] * COMMON["num_key_value_heads"] * 32 * 512 * 4
    return folder, held, float_bytes, kv


def test_a_checkpoint_kept_packed_fits_as_it_is_held_and_holds_what_was_counted(fp8_checkpoint, monkeypatch):
    folder, held, float_bytes, kv = fp8_checkpoint
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: held + kv - 1)
    with pytest.raises(ValueError) as error:
        LLM(model=str(folder), dtype="float32", num_blocks=64)
    assert str(error.value).startswith(f"the model does not fit in cpu's memory: its weights take {mib(held)} packed "
                                       f"({mib(float_bytes)} in float32)")  # fmt: skip
    monkeypatch.setattr(memory_plan, "available_host_memory", lambda: held + kv)
    llm = LLM(model=str(folder), dtype="float32", num_blocks=64)
    assert weight_bytes(llm.engine) == held


def _quantized_checkpoint(kind: str, folder) -> None:
    """A tiny checkpoint stored as ``kind`` in ``folder``."""
    if kind.startswith("fp8"):
        quantization = {"fp8-blocks-32x48": BLOCKS, "fp8-blocks-128x128": BLOCKS_128, "fp8-rows": ROWS}[kind]
        config = LlamaConfig(**FP8_WIDE, architectures=["LlamaForCausalLM"])  # rows of whole 128-value blocks
        write_fp8_checkpoint(save_tiny_model(config, folder / "float"), folder, quantization)
    elif kind in INT4_CASES:
        write_int4_checkpoint(folder, kind)
    elif kind == "w4-group32":
        hf = save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder / "float")
        write_packed_integer_checkpoint(hf, folder, packed_integer_scheme(4, 32, True))
    else:
        config = Qwen3MoeConfig(**{**FP8_WIDE, "num_hidden_layers": 1}, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=128, architectures=["Qwen3MoeForCausalLM"])  # fmt: skip
        write_fp4_checkpoint(save_tiny_model(config, folder / "float"), folder, kind, fused_experts=kind == "gpt-oss")


@pytest.mark.parametrize(
    "kind", ["fp8-blocks-32x48", "fp8-blocks-128x128", "fp8-rows", *INT4_CASES, "w4-group32", "gpt-oss",
             "nvfp4-pack-quantized", "modelopt"],
)  # fmt: skip
def test_the_fit_check_counts_each_weight_of_a_quantized_checkpoint_as_loading_holds_it(kind, tmp_path):
    """From the files' headers alone, each weight packed or decoded as loading decides from the values: FP8 blocks
    narrower than 128 columns, activation-ordered GPTQ and compressed-tensors' integers decoded, the others packed
    (stacked experts too)."""
    _quantized_checkpoint(kind, tmp_path)
    config = load_config(tmp_path)
    held = held_model(tmp_path, config, torch.float32, "auto")
    assert all(p.is_meta for p in held.parameters())
    packed = any(isinstance(p, QuantizedTensor) for p in held.parameters())
    assert packed == (kind not in ("fp8-blocks-32x48", "gptq-desc-act", "w4-group32"))
    assert held_as(held) == held_as(load_model(tmp_path, config, torch.device("cpu"), torch.float32, "auto"))


def test_the_header_only_build_drops_its_own_lines_and_no_other_threads(model_dir, monkeypatch, caplog):
    """What loading kept, skipped or warns of, logged while :func:`held_model` builds (the load that reads the files
    says it again: the server's checks and the engine's each build one, and a warning printed three times), is
    dropped; a line another thread logs meanwhile (the server answering /health) is kept. logging.disable dropped
    both: it is process-wide."""
    build = loader.build_model

    def building(*args, **kwargs):
        other = threading.Thread(target=lambda: logging.getLogger("uvicorn.access").info("GET /health 200"))
        other.start()
        other.join()
        logging.getLogger("xinfer.loading.weights").info("3 checkpoint tensor(s) not used by the model")
        logging.getLogger("xinfer_deepseek.checkpoint_v4").info("kept 4 MXFP4 weights packed")
        logging.getLogger("xinfer.loading.gguf").warning("2 tensor(s) have no HF counterpart")
        return build(*args, **kwargs)

    monkeypatch.setattr(loader, "build_model", building)
    with caplog.at_level(logging.INFO):
        held_model(Path(model_dir), load_config(Path(model_dir)), torch.float32, "auto")
        logging.getLogger("xinfer.loading.weights").info("after it")
    messages = [record.getMessage() for record in caplog.records]
    assert messages == ["GET /health 200", "after it"]
