"""What the core and plugins' kernels ask the backend in use about its device (xinfer.ops.DeviceHooks):
the launch chain a plugin's Triton kernel joins, and host buffers for copies to the device."""

import pytest
import torch

from xinfer import kernel_api, ops
from xinfer.torch_ops import TorchOps
from xinfer_cuda.kernels import launch
from xinfer_cuda.ops import CudaOps

CPU = torch.device("cpu")


class Chained(TorchOps):
    name = "chained"

    def launch_chain(self, device: torch.device) -> dict:
        return {"ENTER": launch.pdl_enter, "launch_pdl": device.type == "cpu"}


def test_a_kernel_joins_the_chain_of_the_backend_in_use_and_none_outside_one():
    assert kernel_api.launch_chain(CPU) == {"ENTER": kernel_api.enter_nothing}
    with ops.use(TorchOps()):
        assert kernel_api.launch_chain(CPU) == {"ENTER": kernel_api.enter_nothing}
    with ops.use(Chained()):
        assert kernel_api.launch_chain(CPU) == {"ENTER": launch.pdl_enter, "launch_pdl": True}


def test_the_cuda_backend_chains_plugin_kernels_where_the_gpu_launches_dependents(monkeypatch):
    monkeypatch.setattr(launch, "_device_supports_pdl", lambda index: index == 0)  # sm_90 and an sm_80
    backend = CudaOps()
    assert backend.launch_chain(torch.device("cuda", 0)) == {"ENTER": launch.pdl_enter, "launch_pdl": True}
    assert backend.launch_chain(torch.device("cuda", 1)) == {}
    assert backend.launch_chain(CPU) == {}  # (kernels under the interpreter)


def test_host_buffers_are_plain_on_the_base():
    buffer = TorchOps().host_buffer((3, 5), torch.int32)
    assert (buffer.shape, buffer.dtype, buffer.device, buffer.is_pinned()) == ((3, 5), torch.int32, CPU, False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs a CUDA device")
def test_the_cuda_backends_host_buffers_are_pinned():
    buffer = CudaOps().host_buffer((3, 5), torch.int32)
    assert (buffer.shape, buffer.dtype, buffer.device, buffer.is_pinned()) == ((3, 5), torch.int32, CPU, True)
