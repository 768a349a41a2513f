"""Host tensors shared through shared memory: a mapping sees the owner's writes, views of one
storage share one handle, and a cache larger than the free shared memory is refused unmoved."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
import torch

from xinfer.distributed import shared_memory
from xinfer.distributed.shared_memory import open_shared, share


def test_views_of_one_storage_share_one_handle_and_the_mapping_sees_writes():
    whole = torch.arange(12, dtype=torch.float32)
    handles = share([whole, whole[4:].view(2, 4)])
    assert len(handles["storages"]) == 1
    mapped, view = open_shared(handles)
    whole[5] = -1.0  # written after sharing: the storage moved, the tensor followed it
    assert view.tolist() == [[4.0, -1.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]
    assert torch.equal(mapped, whole)


def test_a_cache_larger_than_the_free_shared_memory_is_refused(monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(1 << 20, 1 << 20, 1024))
    cache = torch.zeros(1024, dtype=torch.float32)  # 4 KiB
    with pytest.raises(RuntimeError, match="MiB free"):
        share([cache])
    assert not cache.untyped_storage().is_shared()
    assert shared_memory.SHM.exists()  # the check ran where torch puts shared storages
