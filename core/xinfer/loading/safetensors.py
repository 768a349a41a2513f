"""Tensors of an HF folder's safetensors files, sharded or not, each read when its loader asks
(:class:`~xinfer.loading.stored.StoredTensor`: a rank reads only its slice of a split tensor)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor
from tqdm.auto import tqdm

from xinfer.loading.errors import ModelFileError, first_line
from xinfer.loading.stored import StoredTensor


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ModelFileError(f"{index}: not a safetensors index ({type(error).__name__}: {error})") from None
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        why = f" (xinfer reads safetensors, not {', '.join(others)})" if others else ""
        raise ModelFileError(
            f"{folder} has config.json but no weights: no *.safetensors file{why}; "
            f"--load-format dummy runs it with random weights"
        )
    return files


def check_safetensors(folder: Path) -> None:
    """Every file of the checkpoint is there and its header reads (a truncated file's does not), and no tensor is
    in two files (which one a model took would depend on the files' order: a stray copy beside
    model.safetensors replaced its weights): a bad checkpoint fails before the model is built, in one line
    naming the file."""
    seen: dict[str, Path] = {}
    for path in safetensors_files(folder):
        for name in _opened(path).keys():  # noqa: SIM118 - a safetensors handle is not iterable
            if (first := seen.setdefault(name, path)) != path:
                raise ModelFileError(f"{path}: tensor {name} is in {first.name} too: which one is the model's? "
                                     "(a safetensors index, model.safetensors.index.json, names one file a tensor)")  # fmt: skip


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
    if not path.is_file():
        raise ModelFileError(f"{path}: missing (model.safetensors.index.json names it)")
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except SafetensorError as error:
        raise ModelFileError(
            f"{path}: not a readable safetensors file, truncated or corrupt ({first_line(error)})"
        ) from None


def header_tensors(folder: Path) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's tensors on the meta device, from the files' headers: their shapes and dtypes, no data;
    but those that may hold a shape are read (compressed-tensors' ``weight_shape``: the packed words leave a
    row's last word part empty)."""
    for path in safetensors_files(folder):
        handle = _opened(path)
        for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
            stored = StoredTensor(handle, name)
            if _may_hold_a_shape(stored):
                yield name, stored.read()
            else:
                yield name, torch.empty(stored.shape, dtype=stored.dtype, device="meta")


def _may_hold_a_shape(stored: StoredTensor) -> bool:
    """A vector of a few integers."""
    return len(stored.shape) == 1 and stored.shape[0] <= 8 and not stored.dtype.is_floating_point
