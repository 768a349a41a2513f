"""Where the deepseek plugin's kernels run: ``XINFER_KERNEL_DEVICE`` as in
tests/backends/conftest.py ("cpu": under the Triton interpreter, switched on before any
kernel module is imported)."""

import os

import torch

if "XINFER_KERNEL_DEVICE" not in os.environ:
    os.environ["XINFER_KERNEL_DEVICE"] = "cuda" if torch.cuda.is_available() else "cpu"
if os.environ["XINFER_KERNEL_DEVICE"] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
