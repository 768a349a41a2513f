"""K split over several programs of a linear's output tile: each writes its fp32 partial sum,
a second small kernel adds them (and the bias) into ``y``. Over few output tiles (N small
beside the 132 SMs of an H200, a decode step's 4,096-row projections in 64 tiles) that keeps
more of the weight in flight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from xinfer_cuda.kernels import launch
from xinfer_cuda.kernels.launch import pdl_entry


def k_splits(steps: int, split: int, per_step: int) -> tuple[int, int]:
    """A program's share of ``steps`` units along K (whole loop steps of ``per_step`` units) and
    the programs that takes, at most ``split``."""
    share = triton.cdiv(triton.cdiv(steps, split), per_step) * per_step
    return share, triton.cdiv(steps, share)


def partial_sums(y: Tensor, split: int) -> Tensor:
    """Where ``split`` programs write their sums of ``y`` [M, N]: ``y`` itself for one."""
    return torch.empty(split, *y.shape, dtype=torch.float32, device=y.device) if split > 1 else y


def sum_splits(partial: Tensor, bias: Tensor | None, y: Tensor) -> Tensor:
    """``y`` (contiguous) as the sum over the first dimension of ``partial`` (+ ``bias`` on each row);
    ``y`` itself where ``partial`` is ``y``."""
    if partial is y:
        return y
    size, block = y.numel(), 256
    _sum_splits_kernel[(triton.cdiv(size, block),)](partial, bias if bias is not None else y, y, size, y.shape[-1],
                                                    partial.shape[0], SPLITS=triton.next_power_of_2(partial.shape[0]),
                                                    HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
                                                    **launch.pdl(y.device))  # fmt: skip
    return y


@triton.jit
def _sum_splits_kernel(partial_ptr, bias_ptr, y_ptr, size, N, split, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    pdl_entry(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.arange(0, SPLITS)[:, None]
    y = tl.sum(tl.load(partial_ptr + s * size + i[None, :], mask=(s < split) & (i[None, :] < size), other=0.0), axis=0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + i % N, mask=i < size, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=i < size)
