"""Tensors of one process opened by another process on the same host, through torch's own sharing:
a host tensor's storage moves into a shared-memory file (``torch_shm_manager`` unlinks it once the
processes that mapped it are gone), an accelerator tensor is exported as a CUDA IPC handle. The
handles are plain JSON (bytes in base64), never pickles: the peer is reached over HTTP.
"""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from socket import gethostname
from typing import Any

import torch
from torch import Tensor

Handle = dict[str, Any]
SHM = Path("/dev/shm")  # where torch puts shared host storages on Linux


def host_id() -> str:
    """Names this host for this boot: equal in two processes only where they share memory."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return boot.read_text().strip() if boot.exists() else gethostname()


def share(tensors: list[Tensor]) -> dict[str, list[Handle]]:
    """Handles to ``tensors`` that :func:`open_shared` opens in another process of this host, one
    per storage; a host tensor's storage moves into shared memory (its views follow it)."""
    _check_room([t.untyped_storage() for t in tensors])
    storages: dict[int, int] = {}
    shared: list[Handle] = []
    views: list[Handle] = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage itself (sharing a host storage moves its data)
        if key not in storages:
            storages[key] = len(shared)
            shared.append(_share(storage))
        views.append({"storage": storages[key], "dtype": str(tensor.dtype).removeprefix("torch."),
                      "offset": tensor.storage_offset(), "size": list(tensor.shape), "stride": list(tensor.stride())})  # fmt: skip
    return {"storages": shared, "tensors": views}


def open_shared(handles: dict[str, list[Handle]]) -> list[Tensor]:
    """The tensors :func:`share` gave handles to, mapped into this process."""
    storages = [_open(handle) for handle in handles["storages"]]
    return [
        torch.empty(0, dtype=_dtype(view["dtype"]), device=storages[view["storage"]].device).set_(
            storages[view["storage"]], view["offset"], view["size"], view["stride"]
        )
        for view in handles["tensors"]
    ]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RuntimeError(f"{name!r} is not a torch dtype")
    return dtype


def _check_room(storages: list[torch.UntypedStorage]) -> None:
    """Refuses to move host storages into more shared memory than is free (a container's small
    ``/dev/shm``, written past its end, kills the process with SIGBUS)."""
    moving = {s._cdata: s.nbytes() for s in storages if s.device.type == "cpu" and not s.is_shared()}
    if moving and SHM.exists() and sum(moving.values()) > shutil.disk_usage(SHM).free:
        raise RuntimeError(f"{SHM} has {shutil.disk_usage(SHM).free >> 20} MiB free, the cache needs "
                           f"{sum(moving.values()) >> 20} MiB")  # fmt: skip


def _share(storage: torch.UntypedStorage) -> Handle:
    if storage.device.type == "cpu":
        manager, name, size = storage._share_filename_cpu_()
        return {"manager": manager.decode(), "name": name.decode(), "size": size}
    device, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
    return {"device": device, "handle": _text(handle), "size": size, "offset": offset, "counter": _text(counter),
            "counter_offset": counter_offset, "event": _text(event), "sync": sync}  # fmt: skip


def _open(handle: Handle) -> torch.UntypedStorage:
    if "manager" in handle:
        return torch.UntypedStorage._new_shared_filename_cpu(
            handle["manager"].encode(), handle["name"].encode(), handle["size"]
        )
    return torch.UntypedStorage._new_shared_cuda(
        handle["device"], _bytes(handle["handle"]), handle["size"], handle["offset"], _bytes(handle["counter"]),
        handle["counter_offset"], _bytes(handle["event"]), handle["sync"],
    )  # fmt: skip


def _text(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
