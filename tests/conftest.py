"""Shared fixtures, and where the Triton kernels run in every test.

``XINFER_KERNEL_DEVICE`` picks the kernels' device ("cuda" or "cpu"); unset, a CUDA device is
used when there is one. On "cpu" the kernels run under the Triton interpreter, which must be
switched on before any kernel module is imported (``@triton.jit`` reads it then): here, before
any test module is collected, since one test file's imports (the backend's launch helpers, a
plugin's kernels) serve the next file's kernels in the same process.
"""

import os

import pytest
import torch

if "XINFER_KERNEL_DEVICE" not in os.environ:
    os.environ["XINFER_KERNEL_DEVICE"] = "cuda" if torch.cuda.is_available() else "cpu"
if os.environ["XINFER_KERNEL_DEVICE"] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

# under pytest-xdist (`-n N`) each worker takes its share of the cores, as tensor-parallel ranks do
torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture
def cuda_backend():
    """The CUDA backend in use, for tests that call plugins' Triton kernels directly: a kernel
    takes its launch chain and helpers from the backend in use (xinfer.kernel_api), as when
    the engine runs it."""
    from xinfer import ops
    from xinfer_cuda.ops import CudaOps

    with ops.use(CudaOps()):
        yield


@pytest.fixture(scope="session")
def output_dir():
    """Where tests leave files for a person to look at (screenshots, logs)."""
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "test-output")
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_vl(tmp_path_factory):
    """A tiny random Qwen3-VL (transformers' model, fp32, eager attention) and its checkpoint folder,
    written once for the plugin's and the server's tests; the folder is read-only to them."""
    from transformers import Qwen3VLForConditionalGeneration

    from tests.plugins.qwen.vl_fixtures import save_randomized, tiny_vl_config

    folder = tmp_path_factory.mktemp("qwen3_vl")
    config = tiny_vl_config()
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(config).float().eval()
    save_randomized(hf, folder)
    return hf, folder
