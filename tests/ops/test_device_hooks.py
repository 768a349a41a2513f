"""What the core and plugins' kernels ask the backend in use about its device (xinfer.ops.DeviceHooks):
the launch chain a plugin's Triton kernel joins and the jit helpers it borrows, and host buffers for
copies to the device. The core itself imports no Triton."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xinfer import kernel_api, ops
from xinfer.ops import KernelHelpers
from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import arrivals, launch, shared
from xinfer_cuda.ops import CudaOps

CPU = torch.device("cpu")
CORE = Path(__file__).resolve().parents[2] / "core" / "xinfer"


class Chained(TorchOps):
    name = "chained"

    def launch_chain(self, device: torch.device) -> dict:
        return {"ENTER": launch.pdl_enter, "launch_pdl": device.type == "cpu"}


def test_a_kernel_joins_the_chain_of_the_backend_in_use():
    with ops.use(Chained()):
        assert kernel_api.launch_chain(CPU) == {"ENTER": launch.pdl_enter, "launch_pdl": True}


def test_a_kernel_outside_a_backend_that_runs_triton_is_one_clear_error():
    with pytest.raises(RuntimeError, match="no backend in use"):
        kernel_api.launch_chain(CPU)
    with ops.use(TorchOps()), pytest.raises(NotImplementedError, match="the torch backend runs no Triton kernels"):
        kernel_api.helpers()


def test_the_cuda_backend_chains_plugin_kernels_where_the_gpu_launches_dependents(monkeypatch):
    monkeypatch.setattr(launch, "_device_supports_pdl", lambda index: index == 0)  # sm_90 and an sm_80
    backend = CudaOps()
    assert backend.launch_chain(torch.device("cuda", 0)) == {"ENTER": launch.pdl_enter, "launch_pdl": True}
    assert backend.launch_chain(torch.device("cuda", 1)) == {"ENTER": launch.enter_nothing}
    assert backend.launch_chain(CPU) == {"ENTER": launch.enter_nothing}  # (kernels under the interpreter)


def test_the_cuda_backend_lends_its_own_kernels_helpers():
    with ops.use(CudaOps()):
        assert kernel_api.helpers() == KernelHelpers(tile_owner=shared.tile_owner, fp8_value=shared.fp8_value,
                                                     last_to_arrive=arrivals.last_to_arrive, counters=arrivals.counters)  # fmt: skip


def test_decode_splits_fill_two_waves_in_powers_of_two_up_to_the_limit():
    # 132 SMs, 8 KV heads: 264 programs wanted over 8 pairs = 33 splits, rounded up to 64
    assert kernel_api.decode_num_splits(1, 8, 1 << 20, 132, 64) == 64
    assert kernel_api.decode_num_splits(4, 8, 1 << 20, 132, 64) == 16  # 264 / 32 pairs = 9 splits -> 16
    assert kernel_api.decode_num_splits(1, 8, 3 * 64, 132, 64) == 4  # 3 useful splits of 64 keys -> 4
    assert kernel_api.decode_num_splits(512, 8, 1 << 20, 132, 64) == 1
    assert kernel_api.decode_num_splits(1, 1, 1 << 20, 1024, 64) == kernel_api.MAX_SPLITS


def test_the_core_imports_no_triton():
    found = [
        f"{path.relative_to(CORE)}:{node.lineno}"
        for path in CORE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "triton" for alias in node.names))
        or (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "triton")
    ]
    assert not found, found


def test_the_core_and_its_ops_run_where_triton_cannot_be_imported():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # (an import of it raises ImportError)
        "import torch, xinfer, xinfer.ops, xinfer.kernel_api\n"
        "from xinfer.torch_ops import TorchOps\n"
        "with xinfer.ops.use(TorchOps()):\n"
        "    print(xinfer.ops.silu_and_mul(torch.tensor([[1.0, 2.0]])).item())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == pytest.approx(torch.nn.functional.silu(torch.tensor(1.0)).item() * 2.0)


def test_host_buffers_are_plain_on_the_base():
    buffer = TorchOps().host_buffer((3, 5), torch.int32)
    assert (buffer.shape, buffer.dtype, buffer.device, buffer.is_pinned()) == ((3, 5), torch.int32, CPU, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device")
def test_the_cuda_backends_host_buffers_are_pinned():
    buffer = CudaOps().host_buffer((3, 5), torch.int32)
    assert (buffer.shape, buffer.dtype, buffer.device, buffer.is_pinned()) == ((3, 5), torch.int32, CPU, True)
