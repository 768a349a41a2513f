"""What this backend's Triton kernels share, and lend plugins' kernels through
:meth:`xinfer_cuda.ops.CudaOps.kernel_helpers` (see :mod:`xinfer.kernel_api`)."""

from __future__ import annotations

import triton
import triton.language as tl

from xinfer import kernel_api
from xinfer.kv.codes import FP8_MAX
from xinfer.ops import KernelHelpers
from xinfer_cuda.kernels import arrivals

NEG_BIG: tl.constexpr = tl.constexpr(kernel_api.NEG_BIG)
FP8_MAX_C: tl.constexpr = tl.constexpr(FP8_MAX)


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


@triton.jit
def fp8_value(bits):
    """e4m3fn bits -> value / 256 as fp16: the bits moved into an fp16 (same mantissa,
    the exponent bias differs by 8; subnormals stay exact)."""
    b = bits.to(tl.int16)
    h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return h.to(tl.float16, bitcast=True)


@triton.jit
def prefetch_l2(ptrs):
    """Each of ``ptrs``' 128-byte lines fetched into L2, a hint that returns at once: loads
    whose addresses are known before a kernel may read its inputs (``pdl_entry``)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)  # fmt: skip


HELPERS = KernelHelpers(tile_owner=tile_owner, fp8_value=fp8_value, last_to_arrive=arrivals.last_to_arrive,
                        counters=arrivals.counters)  # fmt: skip
