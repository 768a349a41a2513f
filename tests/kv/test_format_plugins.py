"""KV cache formats are open to plugins: a format registered through the
``xinfer_kv_formats`` hook is a ``kv_cache_dtype`` like the built-in ones (which register
the same way), runs on the plain-torch backend, and a backend without kernels for it
refuses it at start-up."""

import sys

import pytest
from transformers import LlamaConfig

from tests.tiny_models import COMMON, prompt, save_tiny_model
from xinfer import LLM, SamplingParams, registry
from xinfer.backend import check_support
from xinfer.config import CacheConfig, EngineConfig
from xinfer.hooks import BackendSpec, hookimpl
from xinfer.kv import KVFormat, formats, get_format
from xinfer.kv.codecs import Fp8, Uniform
from xinfer_cuda.ops import CudaOps

# e4m3 keys without the rotation, 8-bit uniform values: a format no built-in one is
PLAIN_FP8 = KVFormat("plain-fp8", Fp8(), Uniform(levels=255, bits=8))


@hookimpl
def xinfer_kv_formats():
    return {"plain-fp8": f"{__name__}:PLAIN_FP8"}


@pytest.fixture
def with_format(monkeypatch):
    found = registry.discover(["cpu", "llama"], modules={"plain-fp8": sys.modules[__name__]})
    monkeypatch.setattr(registry, "discovery", lambda: found)


def test_the_built_in_formats_come_through_the_hook(monkeypatch):
    found = registry.discover([])  # no installed plugin: the core's own
    monkeypatch.setattr(registry, "discovery", lambda: found)
    assert set(registry.kv_formats()) == {"fp8", "turbo8", "turbo4", "turbo3", "turbo4-lm", "turbo3-lm"}
    assert registry.BUILTIN in dict(found.manager.list_name_plugin())


def test_a_plugin_format_is_an_engine_option_and_runs_on_the_cpu(with_format, tmp_path):
    assert formats()["plain-fp8"] is PLAIN_FP8 and get_format("plain-fp8") is PLAIN_FP8
    assert CacheConfig(kv_cache_dtype="plain-fp8").kv_cache_dtype == "plain-fp8"
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [prompt(30, seed=i) for i in range(4)]
    auto = LLM(model=str(tmp_path), dtype="float32", num_blocks=64).generate(prompts, params)
    plugged = LLM(model=str(tmp_path), dtype="float32", num_blocks=64, kv_cache_dtype="plain-fp8")
    layers = [m for m in plugged.engine.model.modules() if hasattr(m, "cache_spec")]
    assert all(layer.cache.format is PLAIN_FP8 for layer in layers)
    assert set(layers[0].cache.tensors) == {"k", "k_scale", "v", "v_scale"}
    got = plugged.generate(prompts, params)
    assert sum(a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0] for a, b in zip(auto, got)) >= 3


def test_a_backend_without_kernels_for_it_refuses_it(with_format):
    config = EngineConfig.from_kwargs(kv_cache_dtype="plain-fp8")
    with pytest.raises(
        ValueError, match=r"the cuda backend does not support kv_cache_dtype \(--kvcache-dtype\) 'plain-fp8'"
    ):
        check_support(BackendSpec("cuda", "cuda", "-", "-"), CudaOps(), config)
