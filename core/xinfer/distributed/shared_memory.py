"""Tensors of one process opened by another process on the same host, through torch's own sharing:
a host tensor's storage moves into a shared-memory file (``torch_shm_manager`` unlinks it once the
processes that mapped it are gone), an accelerator tensor is exported as a CUDA IPC handle. The
handles are plain JSON (bytes in base64), never pickles: the peer is reached over HTTP.
"""

from __future__ import annotations

import base64
from pathlib import Path
from socket import gethostname
from typing import Any

import torch
from torch import Tensor

Handle = dict[str, Any]


def host_id() -> str:
    """Names this host for this boot: equal in two processes only where they share memory."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return boot.read_text().strip() if boot.exists() else gethostname()


def share(tensors: list[Tensor]) -> dict[str, list[Handle]]:
    """Handles to ``tensors`` that :func:`open_shared` opens in another process of this host, one
    per storage; a host tensor's storage moves into shared memory (its views follow it)."""
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
        torch.empty(0, dtype=getattr(torch, view["dtype"]), device=storages[view["storage"]].device).set_(
            storages[view["storage"]], view["offset"], view["size"], view["stride"]
        )
        for view in handles["tensors"]
    ]


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
    torch.cuda.init()
    return torch.UntypedStorage._new_shared_cuda(
        handle["device"], _bytes(handle["handle"]), handle["size"], handle["offset"], _bytes(handle["counter"]),
        handle["counter_offset"], _bytes(handle["event"]), handle["sync"],
    )  # fmt: skip


def _text(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)
