"""The last program to finish a piece of work does what follows it, in the same launch:
a counter per piece that each of its programs increments when done, the last one resets
and goes on (merging split partials, routing from a router's logits). At batch 1 the
launch that would follow costs more than its work (2-3 us in a CUDA graph).

Each program's stores before :func:`last_to_arrive` (every thread's: a barrier first)
are released by its count; the last program acquires them with its own, and reads them
with ``cache_modifier=".cg"`` (past L1, which is not coherent across programs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_COUNTERS: dict[tuple[torch.device, str], list[Tensor]] = {}  # the counters, and those before (graphs hold them)


def counters(device: torch.device, user: str, count: int, dtype: torch.dtype = torch.int32) -> Tensor | None:
    """``count`` zeroed counters of ``user`` (kernels that run concurrently use their own),
    left at zero again by the kernels; None inside a CUDA graph capture when fewer were
    allocated before it (the caller launches the follow-up kernel then). A ``dtype`` other
    than int32: sums the programs add into, which the last one zeroes again."""
    buffers = _COUNTERS.setdefault((device, user), [])
    if not buffers or buffers[-1].numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buffers.append(torch.zeros(max(count, 1024), dtype=dtype, device=device))
    return buffers[-1]


@triton.jit
def last_to_arrive(counter_ptr, total):
    """Whether this program is the last of the ``total`` that count at ``counter_ptr``
    (which it then resets for the next launch)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == total - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
