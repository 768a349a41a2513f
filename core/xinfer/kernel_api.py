"""What Triton kernels share, whichever distribution ships them, in plain Python: the core
imports no Triton (a CPU install of torch lacks it), so the ``@triton.jit`` functions that
kernels share are the backend's, lent at run time to plugins' kernels.

A plugin's kernel takes each such function as a constexpr argument and calls it as it would
call one it imported (Triton inlines a function passed so: the kernel compiles to the same
code). Every kernel takes ``ENTER``, which it calls first, and is launched with
``**launch_chain(device)``: that joins the launch chain of the backend in use. One that
needs more of them takes the fields of :func:`helpers` too. The backend in use fills both
(:class:`xinfer.ops.DeviceHooks`): the CUDA backend, on GPUs with programmatic dependent
launch, hands its wait-for-the-kernel-before and launch-the-next entry and Triton's
``launch_pdl``, and elsewhere an ``ENTER`` that does nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from xinfer import ops
from xinfer.ops import KernelHelpers

LOG2E = 1.4426950408889634  # scores times this: softmax in base 2
# Finite "minus infinity" for running maxima: a row that sees no key in a tile keeps
# exp2(-inf - NEG_BIG) == 0 and exp2(NEG_BIG - NEG_BIG) == 1 instead of NaN. A kernel module
# reads it as ``tl.constexpr(NEG_BIG)`` (Triton reads no other globals).
NEG_BIG = -1.0e30
MAX_SPLITS = 64  # of a decode's keys per (sequence, KV head)


def launch_chain(device: torch.device) -> dict[str, Any]:
    """The launch arguments that make a kernel on ``device`` join the launch chain of the
    backend in use: its ``ENTER`` and the backend's launch options."""
    return ops.current().launch_chain(device)


def helpers() -> KernelHelpers:
    """The ``@triton.jit`` functions that the backend in use lends kernels."""
    return ops.current().kernel_helpers()


def decode_num_splits(
    num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int, min_split: int, waves: int = 2
) -> int:
    """Splits per (sequence, KV head): enough programs for about ``waves`` waves over
    the multiprocessors, from shapes only (graph-safe). A power of two."""
    wanted = -(-waves * num_sms // max(num_seqs * num_kv_heads, 1))
    useful = -(-max_context // min_split)
    splits = max(1, min(wanted, useful, MAX_SPLITS))
    return 1 << (splits - 1).bit_length()
