"""Where the CUDA backend's kernels run in these tests.

``XINFER_KERNEL_DEVICE`` picks it ("cuda" or "cpu"); unset, a CUDA device is used when
there is one. On "cpu" the kernels run under the Triton interpreter, which must be
switched on before any kernel module is imported (``@triton.jit`` reads it then).
"""

import os

import torch

if "XINFER_KERNEL_DEVICE" not in os.environ:
    os.environ["XINFER_KERNEL_DEVICE"] = "cuda" if torch.cuda.is_available() else "cpu"
if os.environ["XINFER_KERNEL_DEVICE"] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
