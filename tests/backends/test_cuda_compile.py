"""Without a GPU, the kernels still have to get through the GPU compiler (the interpreter
accepts code it rejects): compile_check.py lowers every launch to sm_80 and sm_90 cubins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.skipif(
    os.environ["XINFER_KERNEL_DEVICE"] == "cuda", reason="on a GPU the kernel tests compile for real"
)
@pytest.mark.timeout(1200)  # ~310 compiles: 7.4 minutes from a cold cache on a 2-core machine
def test_kernels_compile_for_sm80_and_sm90():
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("compile_check.py")
    result = subprocess.run(
        [sys.executable, str(script), "90", "80"], env=env, capture_output=True, text=True, timeout=1200
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
