"""A checkpoint tensor not read yet. Under tensor parallelism a rank reads only the slice of a split
tensor it keeps (its module's ``rank_slice``); a replicated tensor, or one whose loading needs it all,
is read whole (:func:`whole`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import Tensor

from xinfer.distributed.group import Slice

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip


class SliceReader(Protocol):
    """A file's view of one tensor (safetensors' ``get_slice``): its shape, dtype and any slice of it."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...

    def __getitem__(self, index: tuple[slice, ...]) -> Tensor: ...


class TensorFile(Protocol):
    """An open safetensors file (``safe_open``)."""

    def get_tensor(self, name: str) -> Tensor: ...

    def get_slice(self, name: str) -> SliceReader: ...


class StoredTensor:
    """Tensor ``name`` of an open safetensors ``file``: its ``shape`` and ``dtype`` as stored known, its
    values read on :meth:`read`, whole or a :class:`~xinfer.distributed.group.Slice`; ``conversions`` (a
    module's ``from_checkpoint``) are applied to what is read."""

    def __init__(self, file: TensorFile, name: str, conversions: tuple[Callable[[Tensor], Tensor], ...] = ()):
        self.file, self.name, self.conversions = file, name, conversions
        reader = file.get_slice(name)
        self.shape, self._dtype = torch.Size(reader.get_shape()), reader.get_dtype()

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self._dtype] if self._dtype in _DTYPES else self.file.get_tensor(self.name).dtype

    def converted(self, conversion: Callable[[Tensor], Tensor]) -> StoredTensor:
        """This tensor with ``conversion`` applied once read (it must treat rows alike: a rank applies it
        to its slice)."""
        return StoredTensor(self.file, self.name, (*self.conversions, conversion))

    def read(self, part: Slice | None = None) -> Tensor:
        if part is None:
            tensor = self.file.get_tensor(self.name)
        else:
            reader, dims = self.file.get_slice(self.name), len(self.shape)

            def rows(dim: int, start: int, count: int) -> Tensor:
                index = [slice(None)] * dims
                index[dim] = slice(start, start + count)
                return reader[tuple(index)]

            tensor = part.padded(part.pieces(rows))
        for conversion in self.conversions:
            tensor = conversion(tensor)
        return tensor


Weights = Iterable[tuple[str, Tensor | StoredTensor]]
"""Checkpoint tensors by name, read or still stored."""


def whole(tensor: Tensor | StoredTensor) -> Tensor:
    """``tensor``'s values, all of them."""
    return tensor.read() if isinstance(tensor, StoredTensor) else tensor


def part_of(tensor: Tensor | StoredTensor, part: Slice) -> Tensor:
    """The slice ``part`` of ``tensor``: only that read where it is still stored."""
    return tensor.read(part) if isinstance(tensor, StoredTensor) else part.of(tensor)
