"""Programmatic dependent launch (sm_90 and later): a kernel may be launched while the
one before it in the stream still runs, so its launch and scheduling overlap the
other's tail instead of following it. A batch-1 decode step is some 350 kernels of
a few microseconds each, so those gaps are a good part of its time.

Every kernel of this backend starts with :func:`pdl_entry`: it waits until the
kernel before it has finished and its writes are visible (before reading anything,
so that completion stays ordered down the whole chain, even for programs that then
return at once), and then lets the next kernel launch. Plugins' kernels join the
chain without importing this backend (:mod:`xinfer.kernel_api`): :func:`launch_chain`
hands them :func:`pdl_enter` as their ``ENTER``, or :func:`enter_nothing`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def pdl_enter():
    gdc_wait()
    gdc_launch_dependents()


@triton.jit
def enter_nothing():
    """``ENTER`` of a launch that joins no chain."""
    pass


@triton.jit
def pdl_entry(PDL: tl.constexpr):
    if PDL:
        pdl_enter()


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(device: torch.device) -> dict[str, bool]:
    """Launch options of a kernel on ``device``: its ``PDL`` argument and Triton's
    ``launch_pdl``, on where the device supports it."""
    on = device.type == "cuda" and _device_supports_pdl(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    return {"PDL": on, "launch_pdl": on}


def launch_chain(device: torch.device) -> dict[str, Any]:
    """The chain's launch arguments for a plugin's kernel on ``device`` (see
    :meth:`xinfer.ops.DeviceHooks.launch_chain`)."""
    return {"ENTER": pdl_enter, "launch_pdl": True} if pdl(device)["PDL"] else {"ENTER": enter_nothing}
