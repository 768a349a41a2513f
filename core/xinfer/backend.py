"""Choosing the backend a run computes with."""

from __future__ import annotations

import torch

from xinfer import registry
from xinfer.config import DeviceConfig
from xinfer.hooks import BackendSpec
from xinfer.ops import Ops


def select_backend(config: DeviceConfig) -> tuple[BackendSpec, Ops, torch.device]:
    """The backend named in ``config``, else the available one of highest priority
    for the requested device type (any device type for ``auto``)."""
    specs = registry.backends()
    if not specs:
        raise RuntimeError("no backend plugin is installed (pip install xinfer-cpu)")
    wanted = None if config.device == "auto" else torch.device(config.device)
    if config.backend is not None:
        candidates = [s for s in specs if s.name == config.backend]
        if not candidates:
            raise ValueError(
                f"unknown backend {config.backend!r}; installed: {', '.join(s.name for s in specs)}"
            )
    else:
        candidates = [s for s in specs if wanted is None or s.device_type == wanted.type]
    available = [s for s in candidates if registry.load_object(s.is_available)()]
    if not available:
        names = ", ".join(f"{s.name} ({s.device_type})" for s in candidates) or "none"
        raise RuntimeError(f"no available backend for device {config.device!r}; candidates: {names}")
    spec = max(available, key=lambda s: s.priority)
    device = wanted if wanted is not None and wanted.type == spec.device_type else torch.device(spec.device_type)
    return spec, registry.load_object(spec.ops)(), device
