"""The Metal backend without a Mac: its registration and selection (mps availability
faked), what it declares and refuses, the memory plan over its unified-memory report
(torch.mps faked), and its kernels' Metal source against what the Python side binds:
every launch runs here against a recording library, so a renamed or retyped argument,
or a codec id that differs between the two, fails in CI. The kernels' numerics run on
Apple hardware only (test_metal_kernels.py)."""

from __future__ import annotations

import logging
import re
from importlib import resources

import pytest
import torch
from transformers import LlamaConfig

from tests.backends.metal_cases import paged_case
from tests.tiny_models import COMMON, save_tiny_model
from xinfer import LLM, registry
from xinfer.backend import select_backend
from xinfer.cache.allocate import bytes_per_block
from xinfer.config import DeviceConfig
from xinfer.engine import build as build_module
from xinfer.engine.memory_plan import DEFAULT_KV_FRACTION, DeviceProfile, GiB, kv_budget, memory_baseline
from xinfer.kv import formats, get_format
from xinfer_metal import plugin
from xinfer_metal.kernels import attention, codecs, kv_write
from xinfer_metal.kernels.codecs import Codec, format_codecs
from xinfer_metal.memory import MetalMemory
from xinfer_metal.ops import MetalOps
from xinfer_metal.shaders import MetalLibrary, parse_kernels

LIBRARIES = [kv_write.LIBRARY, attention.LIBRARY]
CPU = torch.device("cpu")


def source(name: str) -> str:
    return resources.files("xinfer_metal.kernels").joinpath(name).read_text()


# --- registration and selection ---------------------------------------------------------


@pytest.fixture
def on_a_mac(monkeypatch):
    """This machine as a Mac: the mps device available, no CUDA."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_backend_is_registered_for_the_mps_device():
    spec = next(s for s in registry.backends() if s.name == "metal")
    assert spec.device_type == "mps"
    assert registry.load_object(spec.ops) is MetalOps
    assert registry.load_object(spec.memory) is MetalMemory
    assert spec.priority > next(s for s in registry.backends() if s.name == "cpu").priority


def test_a_mac_computes_on_the_metal_backend_by_default(on_a_mac):
    spec, ops, device = select_backend(DeviceConfig())
    assert (spec.name, type(ops), device) == ("metal", MetalOps, torch.device("mps"))


def test_cpu_asked_for_on_a_mac_is_the_cpu(on_a_mac):
    spec, _, device = select_backend(DeviceConfig(device="cpu"))
    assert (spec.name, device) == ("cpu", CPU)


def test_without_mps_the_metal_backend_is_not_chosen(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not plugin.is_available()
    assert select_backend(DeviceConfig())[0].name == "cpu"


def test_a_torch_without_shader_compilation_says_so_and_leaves_the_gpu(on_a_mac, monkeypatch, caplog):
    monkeypatch.delattr(torch.mps, "compile_shader")
    with caplog.at_level(logging.WARNING, logger="xinfer"):
        assert not plugin.is_available()
    assert "torch.mps.compile_shader" in caplog.text and "upgrade torch" in caplog.text
    assert select_backend(DeviceConfig())[0].name == "cpu"


# --- what it declares ---------------------------------------------------------------------


def test_the_declared_formats_are_exactly_those_the_kernels_store_and_read():
    for name, kv_format in formats().items():
        covered = all(format_codecs(kv_format, dtype) for dtype in codecs.PLAIN)
        assert covered == (name in MetalOps.kv_formats), name
    assert {"auto", "fp8", "turbo8", "turbo4"} <= MetalOps.kv_formats


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kv_cache_dtype="turbo3"),
         "the metal backend does not support kv_cache_dtype (--kvcache-dtype) 'turbo3': "
         "choose one of auto, fp8, turbo4, turbo8"),
        (dict(kv_cache_dtype="turbo4-lm"),
         "the metal backend does not support kv_cache_dtype (--kvcache-dtype) 'turbo4-lm': "
         "choose one of auto, fp8, turbo4, turbo8"),
        (dict(kv_cache_dtype="fp8", kv_recent_window=16),
         "the metal backend does not implement kv_recent_window (--kv-recent-window) yet: run without it, or on the CPU"),
    ],
)  # fmt: skip
def test_an_unsupported_option_is_refused_in_one_line_at_start_up(on_a_mac, tmp_path, options, message):
    with pytest.raises(ValueError) as error:
        LLM(model=str(tmp_path / "never-read"), **options)
    assert str(error.value) == message


def test_steps_are_never_captured():
    """No CUDA graphs on Metal: without capture_steps the engine runs every step eagerly."""
    assert getattr(MetalOps(), "capture_steps", None) is None


# --- the memory plan over the unified-memory report ---------------------------------------


class FakeMps:
    """torch.mps's memory statistics: Metal's recommended working set, what this process's
    driver allocations and live tensors hold; emptying the cache gives back what no tensor holds."""

    def __init__(self, recommended: int, driver: int, live: int, heaps: int = 1 << 20):
        self.recommended, self.driver, self.live, self.heaps = recommended, driver, live, heaps

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: self.recommended)
        monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: self.driver)
        monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: self.live)
        monkeypatch.setattr(torch.mps, "synchronize", lambda: None)
        monkeypatch.setattr(torch.mps, "empty_cache", self.empty_cache)

    def empty_cache(self) -> None:
        self.driver = self.live + self.heaps  # the driver's own heaps stay


def test_the_report_is_metals_working_set_less_this_process(monkeypatch):
    fake = FakeMps(recommended=12 * GiB, driver=3 * GiB, live=2 * GiB)
    fake.install(monkeypatch)
    memory = MetalMemory(torch.device("mps"))
    assert memory.info() == (9 * GiB, 12 * GiB)
    assert memory.allocated() == 2 * GiB
    fake.driver = 13 * GiB  # beyond the working set: nothing free, never negative
    assert memory.info() == (0, 12 * GiB)


def test_the_peak_is_what_a_step_left_cached_beyond_the_start(monkeypatch):
    """MPS keeps no peak: a step's freed buffers stay in its allocator's cache, so what the
    driver holds after the step, less its own overhead, bounds the step's peak."""
    fake = FakeMps(recommended=12 * GiB, driver=5 * GiB, live=2 * GiB)
    fake.install(monkeypatch)
    memory = MetalMemory(torch.device("mps"))
    memory.reset_peak()
    assert fake.driver == 2 * GiB + (1 << 20)  # reset released the cache first
    fake.driver += 3 * GiB  # the step's activations, freed into the cache
    assert memory.peak() == 5 * GiB
    memory.release_cached()
    assert memory.peak() == 2 * GiB  # never below the live tensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), folder)
    return str(folder)


def test_the_plan_gives_the_cache_its_share_of_the_working_set(model_dir, monkeypatch, caplog):
    """The whole planning path (on the CPU) over the Metal report: the pool gets the default
    share of Metal's working set less the weights (the fake driver holds only its heaps after the release)."""
    fake = FakeMps(recommended=16 << 20, driver=3 << 20, live=0)
    fake.install(monkeypatch)
    monkeypatch.setattr(build_module, "device_memory", lambda spec, device: MetalMemory(device))
    with caplog.at_level(logging.INFO, logger="xinfer"):
        llm = LLM(model=model_dir, dtype="float32", max_num_batched_tokens=300, max_model_len=128)
    engine = llm.engine
    weights = sum(t.numel() * t.element_size() for t in [*engine.model.parameters(), *engine.model.buffers()])
    budget = int((16 << 20) * DEFAULT_KV_FRACTION) - weights  # activations 0: the fake driver never grows
    assert engine.cache.pools[0].num_blocks == budget // bytes_per_block(
        engine.model, 16, engine.dtype, engine.kv_format
    )
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory plan"))
    assert f"kv_fraction {DEFAULT_KV_FRACTION:g} of 0.02 GiB" in line, line


def test_a_working_set_held_elsewhere_is_refused_naming_the_flag(monkeypatch):
    FakeMps(recommended=8 * GiB, driver=4 * GiB, live=4 * GiB).install(monkeypatch)  # another engine's tensors
    free, total = memory_baseline(MetalMemory(torch.device("mps")))
    profile = DeviceProfile(total, free, weights=GiB, other=0, activations=0, graphs=0)
    with pytest.raises(
        ValueError, match=r"asks for 7.20 GiB of the device's 8.00 GiB, but only 4.00 GiB .*--kv-fraction"
    ):
        kv_budget(profile, DEFAULT_KV_FRACTION)
    assert kv_budget(profile, 0.45) == int(8 * GiB * 0.45) - GiB


# --- the Metal source against what Python binds -------------------------------------------


def constants(text: str) -> dict[str, int]:
    return {m[1]: int(m[2]) for m in re.finditer(r"constant constexpr \w+ (\w+) = (\d+)", text)}


def test_the_codec_ids_agree_with_the_metal_source():
    defined = constants(source("kv_codes.metal"))
    assert {name: defined[name] for name in Codec.__members__} == {c.name: c.value for c in Codec}


def test_the_attention_limits_agree_with_the_metal_source():
    defined = constants(source("paged_attention.metal"))
    assert defined["MAX_HEAD_DIM"] == codecs.MAX_HEAD_DIM == 2 * attention.SIMD * defined["MAX_PAIRS"]
    assert defined["MAX_SIMDGROUPS"] >= max(attention.DECODE_SIMDGROUPS, attention.PREFILL_SIMDGROUPS)


class Recorder:
    """A compiled library that records each launch instead of running it."""

    def __init__(self, library: MetalLibrary):
        self.library, self.calls = library, []

    max_threads_per_threadgroup = 1024

    def __getattr__(self, kernel: str):
        assert kernel in self.library.kernels, f"no kernel {kernel} in {self.library.files}"

        def launch(*args, threads, group_size):
            assert group_size[0] * group_size[1] <= self.max_threads_per_threadgroup
            self.calls.append((kernel, args, threads, group_size))

        launch.max_threads_per_threadgroup = self.max_threads_per_threadgroup  # type: ignore[attr-defined]
        return launch


@pytest.fixture
def recorded(monkeypatch) -> list:
    calls: list = []
    for library in LIBRARIES:
        recorder = Recorder(library)
        recorder.calls = calls
        monkeypatch.setattr(library, "compiled", recorder)
    return calls


STORED = [("auto", torch.float32), ("auto", torch.float16), ("auto", torch.bfloat16),
          ("fp8", torch.float16), ("turbo8", torch.bfloat16), ("turbo4", torch.float32)]  # fmt: skip


@pytest.mark.parametrize("fmt, dtype", STORED, ids=[f"{f}-{str(d)[6:]}" for f, d in STORED])
def test_every_launch_binds_the_arguments_its_source_declares(recorded, fmt, dtype):
    """The write and both attention paths (prefill, decode) bind every argument by the name,
    order and type the kernel's source gives (MetalLibrary.bind checks each), over a grid of
    whole threadgroups of whole simdgroups."""
    cache, k, v, slots, meta = paged_case(fmt, dtype, 64, [19, 7], [4, 7], CPU)
    ops = MetalOps()
    ops.write_kv(k, v, cache, slots)
    q = torch.randn(11, 4, 64).to(dtype)
    assert ops.attend(q, cache, meta, 0.125, window=5, softcap=30.0).shape == q.shape
    meta.cu_seqlens_q, meta.max_seqlen_q = torch.arange(3, dtype=torch.int32), 1
    ops.attend(q[:2], cache, meta, 0.125)
    kernels = [kernel for kernel, *_ in recorded]
    writes = ["write_kv"] if fmt == "auto" else ["quant_write_kv"] * 2
    assert kernels == [*writes, "paged_attention", "paged_attention"]
    for kernel, args, threads, group_size in recorded:
        library = next(lib for lib in LIBRARIES if kernel in lib.kernels)
        assert len(args) == len(library.kernels[kernel])
        assert len(threads) == len(group_size) == 2 and group_size[0] <= 1024
        if kernel != "write_kv":  # simdgroup kernels: whole simdgroups, whole threadgroups
            assert group_size[0] % 32 == 0 and threads[0] % group_size[0] == 0
    (*_, threads, group), (*_, decode_threads, decode_group) = recorded[-2:]
    assert group == [32 * attention.PREFILL_SIMDGROUPS, 1] and threads == [32 * 4, 11]
    assert decode_group == [32 * attention.DECODE_SIMDGROUPS, 1] and decode_threads[1] == 2


def test_decode_takes_fewer_simdgroups_where_metal_allows_fewer_threads(recorded, monkeypatch):
    monkeypatch.setattr(Recorder, "max_threads_per_threadgroup", 128)
    cache, *_, meta = paged_case("auto", torch.float32, 64, [9, 5], [1, 1], CPU)
    MetalOps().attend(torch.randn(2, 4, 64), cache, meta, 0.125)
    assert recorded[-1][3] == [128, 1]


def test_a_renamed_argument_fails_at_the_binding(recorded, monkeypatch):
    renamed = source("paged_attention.metal").replace("k_scale,", "key_scale,")
    monkeypatch.setattr(attention.LIBRARY, "kernels", parse_kernels(source("kv_codes.metal") + renamed))
    cache, *_, meta = paged_case("fp8", torch.float32, 64, [9], [9], CPU)
    with pytest.raises(
        TypeError,
        match=r"paged_attention lacks key_scale and was given k_scale: its source takes q, k_cache, key_scale,",
    ):
        MetalOps().attend(torch.randn(9, 2, 64), cache, meta, 0.125)


def test_a_retyped_argument_fails_at_the_binding(recorded, monkeypatch):
    retyped = source("kv_write.metal").replace("device const long* slot_mapping", "device const int* slot_mapping")
    monkeypatch.setattr(kv_write.LIBRARY, "kernels", parse_kernels(source("kv_codes.metal") + retyped))
    cache, k, v, slots, _ = paged_case("auto", torch.float16, 64, [9], [9], CPU)
    with pytest.raises(
        TypeError, match=r"write_kv, argument slot_mapping \(device const int\*\): expected .*torch.int32"
    ):
        MetalOps().write_kv(k, v, cache, slots)


def test_an_argument_torch_cannot_bind_is_refused_when_parsed():
    with pytest.raises(ValueError, match=r"kernel f: argument 'uint n' is neither"):
        parse_kernels("kernel void f(device float* x, uint n, uint i [[thread_position_in_grid]]) {}")
    with pytest.raises(ValueError, match=r"kernel g: argument 'constant int& n' has a type torch cannot bind"):
        parse_kernels("kernel void g(device float* x, constant int& n) {}")


def test_every_kernel_in_the_sources_is_parsed():
    for library in LIBRARIES:
        declared = set(re.findall(r"\bkernel\s+void\s+(\w+)", library.source))
        assert declared == set(library.kernels) != set()
    assert get_format("turbo4").key.bits == 4  # the pairs the 4-bit reader takes: (j, D/2 + j) in byte j
