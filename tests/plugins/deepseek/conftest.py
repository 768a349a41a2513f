"""The deepseek plugin's package on the path (it is not installed while its pyproject is
being written), and where its kernels run: ``XINFER_KERNEL_DEVICE`` as in
tests/backends/conftest.py ("cpu": under the Triton interpreter, switched on before any
kernel module is imported)."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "plugins" / "deepseek"))

if "XINFER_KERNEL_DEVICE" not in os.environ:
    os.environ["XINFER_KERNEL_DEVICE"] = "cuda" if torch.cuda.is_available() else "cpu"
if os.environ["XINFER_KERNEL_DEVICE"] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
