"""Choosing the backend a run computes with."""

from __future__ import annotations

import os
from typing import Protocol

import torch

from xinfer import registry
from xinfer.config import DeviceConfig, EngineConfig
from xinfer.hooks import BackendSpec
from xinfer.ops import PRIMITIVES, Ops


class DeviceMemory(Protocol):
    """A device's memory as its allocator sees it, for sizing the KV cache (bytes)."""

    def info(self) -> tuple[int, int]:
        """Free and total memory of the device (all processes)."""

    def allocated(self) -> int:
        """Held by this process's tensors now."""

    def reset_peak(self) -> None:
        """Start a new window for :meth:`peak`."""

    def peak(self) -> int:
        """The most held by this process's tensors since :meth:`reset_peak`."""

    def release_cached(self) -> None:
        """Give memory cached by the allocator but held by no tensor back to the device."""


def device_memory(spec: BackendSpec, device: torch.device) -> DeviceMemory | None:
    """The backend's memory statistics for ``device``; None where it keeps none."""
    return registry.load_object(spec.memory)(device) if spec.memory else None


def splits_memory(spec: BackendSpec) -> bool:
    """Whether splitting a model over devices (tensor parallelism, ``--d 0,1``) gives each part memory of
    its own: the backend's devices have memory of their own (``memory``) and there can be several (not
    ``one_device``). The CPU's ranks would share the host's."""
    return spec.memory is not None and not spec.one_device


def select_backend(config: DeviceConfig) -> tuple[BackendSpec, Ops, torch.device]:
    """The backend named in ``config``, else the available one of highest priority
    for the requested device type (any device type for ``auto``)."""
    specs = registry.backends()
    if not specs:
        chosen = os.environ.get("XINFER_PLUGINS")
        raise ValueError(f"no backend plugin is loaded: XINFER_PLUGINS={chosen} names none" if chosen else
                         "no backend plugin is installed (from xinfer's repository: pip install ./backends/cpu)")  # fmt: skip
    wanted = None if config.device == "auto" else torch.device(config.device)
    if config.backend is not None:
        candidates = [s for s in specs if s.name == config.backend]
        if not candidates:
            raise ValueError(f"unknown backend {config.backend!r}; installed: {', '.join(s.name for s in specs)}")
    else:
        candidates = [s for s in specs if wanted is None or s.device_type == wanted.type]
    available = [s for s in candidates if registry.load_object(s.is_available)()]
    if not available:
        names = ", ".join(f"{s.name} ({s.device_type})" for s in candidates) or "none"
        raise ValueError(f"no backend can run device {config.device!r} on this machine (installed for it: {names})")
    spec = max(available, key=lambda s: s.priority)
    device = wanted if wanted is not None and wanted.type == spec.device_type else torch.device(spec.device_type)
    return spec, registry.load_object(spec.ops)(), device


def check_support(spec: BackendSpec, ops: Ops, config: EngineConfig) -> None:
    """Refuse, in one line, an engine ``config`` that the backend does not support (what it
    supports is declared on its ops class, see :class:`xinfer.torch_ops.TorchOps`)."""
    if missing := [name for name in PRIMITIVES if not callable(getattr(ops, name, None))]:
        raise ValueError(f"the {spec.name} backend lacks the ops {', '.join(missing)}: its plugin is incomplete "
                         f"(a backend subclasses xinfer.torch_ops.TorchOps); run on another backend")  # fmt: skip
    cache = config.cache
    if ops.kv_formats is not None and cache.kv_cache_dtype not in ops.kv_formats:
        raise ValueError(f"the {spec.name} backend does not support kv_cache_dtype (--kvcache-dtype) "
                         f"{cache.kv_cache_dtype!r}: choose one of {', '.join(sorted(ops.kv_formats))}")  # fmt: skip
    if cache.kv_recent_window and cache.kv_cache_dtype == "auto":
        raise ValueError(
            "kv_recent_window (--kv-recent-window) keeps recent keys exact beside a quantized "
            "cache: choose one with kv_cache_dtype (--kvcache-dtype fp8, turbo8, turbo4, turbo3)"
        )
    if cache.kv_recent_window and not ops.recent_window:
        raise ValueError(f"the {spec.name} backend does not implement kv_recent_window (--kv-recent-window) yet: "
                         f"run without it, or on the CPU")  # fmt: skip
