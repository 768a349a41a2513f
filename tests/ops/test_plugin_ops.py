"""Ops that plugins register (``xinfer_ops``): a backend runs the kernel registered under
its name, else its own method of the op's name, else the op's torch reference."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from xinfer import ops, registry
from xinfer.hooks import OpSpec, hookimpl
from xinfer.torch_ops import TorchOps
from xinfer_cpu.ops import CpuOps

RAN: list[str] = []  # which implementation of the fused op ran, in order


def norm_and_project(x, residual, norm_weight, eps, proj_weight):
    """The fused op's reference: residual-add + RMSNorm feeding a projection, composed
    of the ops every backend has."""
    RAN.append("reference")
    normed, residual = ops.rms_norm(x, norm_weight, eps, residual)
    return ops.linear(normed, proj_weight), residual


def norm_and_project_cpu(x, residual, norm_weight, eps, proj_weight):
    RAN.append("cpu kernel")
    return fused(x, residual, norm_weight, eps, proj_weight)


def fused(x, residual, norm_weight, eps, proj_weight):
    """A kernel for it: one fp32 pass."""
    summed = x + residual
    x32 = summed.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    return (normed @ proj_weight.float().T).to(x.dtype), summed


class FusingOps(TorchOps):
    """A backend with a method of the op's name."""

    name = "fusing"

    def norm_and_project(self, x, residual, norm_weight, eps, proj_weight):
        RAN.append("method")
        return fused(x, residual, norm_weight, eps, proj_weight)


class FusingCpuOps(FusingOps):
    name = "cpu"


@hookimpl
def xinfer_ops():
    return [OpSpec("norm_and_project", f"{__name__}:norm_and_project", {"cpu": f"{__name__}:norm_and_project_cpu"})]


@pytest.fixture(autouse=True)
def plugin(monkeypatch):
    found = registry.discover([], modules={"fused": sys.modules[__name__]})
    monkeypatch.setattr(registry, "discovery", lambda: found)
    RAN.clear()


def inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(5, 64, generator=generator, dtype=dtype) for _ in range(2))
    return x, residual, torch.rand(64, generator=generator, dtype=dtype) + 0.5, 1e-6, torch.randn(32, 64, dtype=dtype)


@pytest.mark.parametrize(
    "backend, ran",
    [(CpuOps(), "cpu kernel"), (FusingCpuOps(), "cpu kernel"), (FusingOps(), "method"), (TorchOps(), "reference")],
    ids=["kernel", "kernel-over-method", "method", "reference"],
)
def test_each_backend_runs_the_first_of_kernel_method_reference(backend, ran):
    x, residual, norm_weight, eps, proj_weight = inputs()
    with ops.use(backend):
        out, summed = ops.call("norm_and_project", x, residual, norm_weight, eps, proj_weight)
    assert RAN == [ran]
    expected = F.linear(F.rms_norm(x + residual, (64,), norm_weight, eps), proj_weight)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(summed, x + residual)


def test_an_op_resolves_once_per_backend(monkeypatch):
    looked_up = []
    specs = registry.op_specs
    monkeypatch.setattr(registry, "op_specs", lambda: looked_up.append(1) or specs())
    first, second = CpuOps(), CpuOps()
    for backend in (first, second, first):
        with ops.use(backend):
            assert ops.get("norm_and_project") is norm_and_project_cpu
            ops.get("norm_and_project")
    assert len(looked_up) == 2


def test_the_ops_every_backend_has_are_its_methods():
    x = torch.randn(3, 8)
    with ops.use(backend := FusingOps()):
        assert ops.get("silu_and_mul") == backend.silu_and_mul
        torch.testing.assert_close(ops.call("silu_and_mul", x), F.silu(x[:, :4]) * x[:, 4:])


def test_an_unknown_op_is_one_line_naming_the_known_ones():
    with ops.use(CpuOps()), pytest.raises(ValueError) as error:
        ops.call("gated_delta_rule", torch.ones(1))
    message = str(error.value)
    assert "\n" not in message and message.startswith("unknown op 'gated_delta_rule'; known ops: ")
    assert all(f" {name}," in message for name in ("attention", "linear", "norm_and_project", "rms_norm"))


PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "xinfer-doubling"
version = "0.0.1"

[project.entry-points.xinfer]
doubling = "xinfer_doubling"
"""

MODULE = """
from xinfer.hooks import OpSpec, hookimpl


def double(x):
    return x * 2


def double_cpu(x):
    return x + x + 0.5  # tells the kernel from the reference


@hookimpl
def xinfer_ops():
    return [OpSpec("double", "xinfer_doubling:double", {"cpu": "xinfer_doubling:double_cpu"})]
"""

RUN = """
import json, torch
from xinfer import ops
from xinfer.registry import plugins
from xinfer.torch_ops import TorchOps
from xinfer_cpu.ops import CpuOps
x = torch.arange(3.0)
with ops.use(CpuOps()):
    on_cpu = ops.call("double", x).tolist()
with ops.use(TorchOps()):
    reference = ops.call("double", x).tolist()
hooks = next(p.hooks for p in plugins() if p.name == "doubling")
print(json.dumps({"cpu": on_cpu, "reference": reference, "hooks": hooks}))
"""


def test_a_pip_installed_plugin_adds_an_op_and_its_cpu_kernel(tmp_path):
    package = tmp_path / "xinfer-doubling"
    package.mkdir()
    (package / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (package / "xinfer_doubling.py").write_text(textwrap.dedent(MODULE))
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(package)],
        check=True,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", RUN], env=env, capture_output=True, text=True, check=True)
    got = json.loads(result.stdout.strip().splitlines()[-1])
    assert got == {"cpu": [0.5, 2.5, 4.5], "reference": [0.0, 2.0, 4.0], "hooks": ["xinfer_ops"]}
