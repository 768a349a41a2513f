"""A pytest plugin that runs engine tests through the CUDA backend's kernels on the CPU, for
reproducing a GPU failure without a GPU:

    XINFER_KERNEL_DEVICE=cpu PYTHONPATH=. python -m pytest -p tests.backends.cuda_interpreted \\
        tests/engine/test_features_by_layer_kind.py -k gemma4

Every ``LLM`` built on the CPU then computes with :class:`~xinfer_cuda.ops.CudaOps` under the
Triton interpreter, on the GPU's code paths where the CPU would leave them: steps padded to the
shapes the step graphs record (:class:`~xinfer_cuda.static_step.StaticStep`, run eagerly), decode
splits for the H200's 132 multiprocessors, and linears of up to 16 rows in the GEMV kernels (one
tile each, where the GPU measures which). It does not reproduce what only the hardware does:
compilation (tests/backends/compile_check.py), concurrency (PDL, atomics, streams) and CUDA graph
capture. Interpreted kernels are slow: minutes a test.
"""

from __future__ import annotations

import os

if os.environ.get("XINFER_KERNEL_DEVICE", "cpu") != "cpu":
    raise RuntimeError("tests.backends.cuda_interpreted runs the kernels on the CPU: set XINFER_KERNEL_DEVICE=cpu")
os.environ["XINFER_KERNEL_DEVICE"] = "cpu"
os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch.nn.functional as F
from torch import Tensor

import xinfer
from xinfer.ops import StepLimits
from xinfer_cuda.kernels import attention
from xinfer_cuda.kernels.gemv import MAX_ROWS
from xinfer_cuda.linear import DOT_TILES, ONE_ROW_TILES, SmallBatchLinear
from xinfer_cuda.ops import CudaOps

H200_MULTIPROCESSORS = 132


class FixedTiles(SmallBatchLinear):
    """A one-row GEMV tile for one row, a dot tile for more, without measuring."""

    def fastest(self, key, weight, baseline, tile_call, tiles):
        rows = {"route": 1, "norm": key[1]}.get(key[0], key[0])
        return ONE_ROW_TILES[7] if rows == 1 else DOT_TILES[2]


class InterpretedCudaOps(CudaOps):
    small_batch_linear = FixedTiles()

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS:  # (CudaOps takes this path on a GPU only)
            return self.small_batch_linear(x, weight, bias)
        return F.linear(x, weight, bias)


class InterpretedLLM(xinfer.LLM):
    def __init__(self, *args, **kwargs):
        from tests.backends.test_step_graphs import EagerStaticSteps

        super().__init__(*args, **kwargs)
        engine, ops = self.engine, InterpretedCudaOps()
        runner = engine.runner
        runner.backend = engine.ops = ops
        scheduler = engine.config.scheduler
        limits = StepLimits(scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                            -(-engine.max_model_len // runner.block_size), engine.max_model_len,
                            runner.num_page_groups, False, runner.has_state)  # fmt: skip
        runner.graphs = EagerStaticSteps(runner, limits)


def pytest_configure(config) -> None:
    attention._num_sms = lambda device: H200_MULTIPROCESSORS
    xinfer.LLM = InterpretedLLM  # (test modules import it from xinfer when collected, after this)
