"""What Triton kernels build on, whichever distribution ships them: the helpers more than one
backend or plugin uses, and the way a kernel joins the launch chain of the backend in use.

Only kernel modules import this module (it imports Triton, which a CPU install of torch lacks).

A kernel joins the chain with a constexpr argument ``ENTER`` that it calls first, and is
launched with ``**launch_chain(device)``. The backend in use fills both
(:meth:`xinfer.torch_ops.TorchOps.launch_chain`): the CUDA backend, on GPUs with programmatic
dependent launch, hands its wait-for-the-kernel-before and launch-the-next entry and Triton's
``launch_pdl``; elsewhere ``ENTER`` does nothing.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from xinfer import ops
from xinfer.kv.codes import FP8_MAX

LOG2E = 1.4426950408889634
# Finite "minus infinity" for running maxima: a row that sees no key in a tile keeps
# exp2(-inf - NEG_BIG) == 0 and exp2(NEG_BIG - NEG_BIG) == 1 instead of NaN.
NEG_BIG: tl.constexpr = tl.constexpr(-1.0e30)
FP8_MAX_C: tl.constexpr = tl.constexpr(FP8_MAX)
MAX_SPLITS = 64  # of a decode's keys per (sequence, KV head)


@triton.jit
def enter_nothing():
    """``ENTER`` of a launch that joins no chain."""
    pass


def launch_chain(device: torch.device) -> dict[str, Any]:
    """The launch arguments that make a kernel on ``device`` join the launch chain of the backend
    in use: its ``ENTER`` and the backend's launch options. A kernel called outside any backend
    (as tests call them) joins none."""
    backend = ops.in_use()
    return {"ENTER": enter_nothing} | (backend.launch_chain(device) if backend is not None else {})


@triton.jit
def tile_owner(cu_seqlens_q_ptr, num_seqs, tile, Q_PER_TILE: tl.constexpr):
    """The sequence whose query tiles include ``tile``, by binary search.

    Sequence ``b``'s tiles start at ``cu_seqlens_q[b] // Q_PER_TILE + b``: one more tile
    per sequence than its share of the flat batch covers a sequence whose queries
    straddle tile boundaries. The starts increase, so the owner is the last sequence
    whose start is at most ``tile``.
    """
    lo = tl.full([], 0, tl.int32)
    hi = lo + num_seqs  # start(lo) <= tile < start(hi), taking start(num_seqs) as infinite
    while hi - lo > 1:
        mid = (lo + hi) // 2
        owns = tl.load(cu_seqlens_q_ptr + mid) // Q_PER_TILE + mid <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    return lo


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, min_split: int, waves: int = 2
) -> int:
    """Splits per (sequence, KV head): enough programs for about ``waves`` waves over
    the multiprocessors, from shapes only (graph-safe). A power of two."""
    wanted = triton.cdiv(waves * num_sms, max(num_seqs * num_kv_heads, 1))
    useful = triton.cdiv(max_context, min_split)
    splits = max(1, min(wanted, useful, MAX_SPLITS))
    return triton.next_power_of_2(splits)


@triton.jit
def fp8_value(bits):
    """e4m3fn bits -> value / 256 as fp16: the bits moved into an fp16 (same mantissa,
    the exponent bias differs by 8; subnormals stay exact)."""
    b = bits.to(tl.int16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True)
