"""Tensors of an HF folder's safetensors files, sharded or not, each read when its loader asks
(:class:`~xinfer.loading.stored.StoredTensor`: a rank reads only its slice of a split tensor)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open
from tqdm.auto import tqdm

from xinfer.loading.stored import StoredTensor


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, StoredTensor]]:
    files = safetensors_files(folder)
    total = sum(len(_opened(path).keys()) for path in files)
    with tqdm(total=total, desc="Loading weights", unit="tensor", leave=False) as bar:
        for path in files:  # one file open at a time: its mapped pages are let go once its tensors are read
            handle = _opened(path)
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                yield name, StoredTensor(handle, name)
                bar.update()


def _opened(path: Path) -> safe_open:
    return safe_open(str(path), framework="pt", device="cpu")
