"""What a backend declares it supports, checked once at start-up: an unsupported
combination is one line naming the backend, the option and what to do."""

import sys

import pytest
from transformers import Qwen2MoeConfig

from tests.docs_pages import REPO
from tests.tiny_models import COMMON, save_tiny_model
from xinfer import LLM, registry
from xinfer.backend import check_support
from xinfer.config import EngineConfig
from xinfer.hooks import BackendSpec, hookimpl
from xinfer.layers.moe import Experts, check_experts_run_on
from xinfer.torch_ops import TorchOps
from xinfer_cpu.ops import CpuOps
from xinfer_cuda.ops import CudaOps


class NoWindowOps(TorchOps):
    """A backend whose attention kernel knows two formats and no shadow blocks, and whose MoE kernel silu alone."""

    name = "nowindow"
    kv_formats = frozenset({"auto", "fp8"})
    recent_window = False
    expert_activations = frozenset({"silu"})

    def attention(self, *args, **kwargs):
        raise AssertionError("a refused engine never computes")


class NoRotaryOps:
    name = "norotary"
    kv_formats = None
    recent_window = False
    linear = rms_norm = silu_and_mul = gelu_tanh_and_mul = gelu_and_mul = fused_moe = moe_route = sample = attention = (
        TorchOps.linear
    )
    apply_token_bitmask = norm_linear = norm_route = TorchOps.linear
    encoder_attention = layer_norm = rotary_attention = sigmoid_gate = add_gated = TorchOps.linear


def available() -> bool:
    return True


@hookimpl
def xinfer_backends():
    return [BackendSpec("nowindow", "cpu", f"{__name__}:NoWindowOps", f"{__name__}:available")]


@pytest.fixture
def with_nowindow(monkeypatch):
    found = registry.discover(["cpu", "qwen"], modules={"nowindow": sys.modules[__name__]})  # (qwen: a MoE model)
    monkeypatch.setattr(registry, "discovery", lambda: found)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kv_cache_dtype="fp8", kv_recent_window=8),
         "the nowindow backend does not implement kv_recent_window (--kv-recent-window) yet: run without it, or on the CPU"),
        (dict(kv_cache_dtype="turbo4"),
         "the nowindow backend does not support kv_cache_dtype (--kvcache-dtype) 'turbo4': choose one of auto, fp8"),
    ],
)  # fmt: skip
def test_the_engine_refuses_an_unsupported_option_before_loading_the_model(with_nowindow, tmp_path, options, message):
    with pytest.raises(ValueError) as error:
        LLM(model=str(tmp_path / "never-read"), backend="nowindow", **options)
    assert str(error.value) == message


def test_experts_whose_activation_the_backend_lacks_are_refused_before_loading(with_nowindow, tmp_path):
    config = Qwen2MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                            hidden_act="relu", architectures=["Qwen2MoeForCausalLM"])  # fmt: skip
    save_tiny_model(config, tmp_path)
    with pytest.raises(NotImplementedError) as error:
        LLM(model=str(tmp_path), backend="nowindow", load_format="dummy")
    assert str(error.value) == (
        "hidden_act 'relu' is not supported in the experts on nowindow; supported there: silu (every one on cpu)"
    )


@pytest.mark.parametrize("activation", ["relu2", "quick_gelu"])
def test_the_cuda_moe_kernels_take_three_activations_and_the_cpu_every_one(activation):
    experts = Experts(4, 8, 8, activation)
    check_experts_run_on(experts, CpuOps())
    with pytest.raises(NotImplementedError, match=f"hidden_act {activation!r} is not supported in the experts on cuda"):
        check_experts_run_on(experts, CudaOps())
    for fused in ("silu", "gelu_pytorch_tanh", "gelu"):
        check_experts_run_on(Experts(4, 8, 8, fused), CudaOps())


def test_an_incomplete_backend_is_refused_naming_the_missing_ops():
    spec = BackendSpec("norotary", "cpu", f"{__name__}:NoRotaryOps", f"{__name__}:available")
    with pytest.raises(ValueError, match=r"^the norotary backend lacks the ops rotary: its plugin is incomplete"):
        check_support(spec, NoRotaryOps(), EngineConfig.from_kwargs())


@pytest.mark.parametrize("ops", [CpuOps(), CudaOps()], ids=["cpu", "cuda"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "turbo3-lm"])
def test_the_shipped_backends_take_every_format_and_the_window(ops, kv_cache_dtype):
    window = 0 if kv_cache_dtype == "auto" else 16
    config = EngineConfig.from_kwargs(kv_cache_dtype=kv_cache_dtype, kv_recent_window=window)
    check_support(BackendSpec(ops.name, "any", "-", "-"), ops, config)


def test_each_installed_backend_names_its_ops_class_as_its_spec():
    specs = registry.backends()
    shipped = {folder.parent.name for folder in (REPO / "backends").glob("*/pyproject.toml")}
    assert shipped and shipped <= {spec.name for spec in specs}  # the repository's, installed beside the core
    for spec in specs:
        assert registry.load_object(spec.ops).name == spec.name
