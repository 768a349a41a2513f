"""The quality benchmark's what-if (benchmarks/exact_window.py) bounds: with every
position exact it is attention over the unquantized K/V, with none it is the CPU
backend's attention over the quantized cache."""

import pytest
import torch

from benchmarks.exact_window import ExactWindow
from tests.kv.test_key_offset import keys_with_a_mean, two_sequences
from xinfer.kv import get_format
from xinfer_cpu.ops import CpuOps

CPU = CpuOps()


@pytest.mark.parametrize("fmt", ["turbo4", "fp8"])
def test_exact_window_bounds(fmt):
    meta, slots, num_blocks = two_sequences([19, 11], [6, 1])
    k, v, q = keys_with_a_mean(30), torch.randn(30, 2, 64), torch.randn(7, 4, 64)
    equalizer = torch.rand(2, 64) + 0.5

    def run(ops, name):
        cache = get_format(name).allocate(num_blocks, 8, 2, 64, torch.float32, torch.device("cpu"))
        if cache.format.rotate_keys:
            cache.key_offset, cache.equalizer = k.mean(0), equalizer
        ops.write_kv(k, v, cache, slots)
        return ops.attention(q, cache, meta, 0.125, window=8)

    exact = run(CPU, "auto")
    quantized = run(CPU, fmt)
    assert (quantized - exact).norm() > 1e-3 * exact.norm()  # the format does lose something
    torch.testing.assert_close(run(ExactWindow(CPU, window=64, sink=0), fmt), exact, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run(ExactWindow(CPU, window=0, sink=64), fmt), exact, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run(ExactWindow(CPU, window=0, sink=0), fmt), quantized, rtol=1e-4, atol=1e-5)
