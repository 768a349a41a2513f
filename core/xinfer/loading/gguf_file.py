"""A GGUF file read in place: metadata as plain Python values, tensors as views of an mmap.

``gguf.GGUFReader`` builds a numpy view per array element, which takes seconds for a
262k-token vocabulary; this reader parses the header with ``struct`` and reads numeric
arrays with one ``np.frombuffer`` each.
"""

from __future__ import annotations

import importlib.metadata
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from xinfer.loading.errors import ModelFileError, amount

_GGUF_VERSION = importlib.metadata.version("gguf")

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF value type -> its scalars' format, read by struct and, for arrays, numpy; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ModelFileError):
    pass


class _HeaderEnds(Exception):
    """The file ends inside its own header."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the reverse of GGML's ne
    ggml_type: GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


class _Cursor:
    def __init__(self, buf: mmap.mmap, pos: int = 0):
        self.buf, self.pos = buf, pos

    def take(self, n: int) -> int:
        """Moves past ``n`` bytes; returns where they start."""
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise _HeaderEnds
        return start

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        return self.buf[start : self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        raise GGUFFormatError(f"unknown GGUF value type {vtype} at byte {self.pos}")

    def array(self) -> list | np.ndarray:
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype])
            return np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.take(count * dtype.itemsize)).copy()
        return [self.value(etype) for _ in range(count)]


class GGUFFile:
    """Metadata and tensor layout of one GGUF file (little-endian, version 2 or 3)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size == 0:
            raise GGUFFormatError(f"{self.path}: empty file (0 bytes)")
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mmap[:4] != _MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file (it does not start with {_MAGIC!r})")
        cur = _Cursor(self._mmap, len(_MAGIC))
        try:
            self._read_header(cur)
        except _HeaderEnds:
            raise GGUFFormatError(f"{self.path}: truncated: {amount(size)} end inside the header") from None
        end = max((info.offset + info.nbytes for info in self.tensors.values()), default=size)
        if end > size:
            raise GGUFFormatError(f"{self.path}: truncated: {amount(size)} of the {amount(end)} the header promises")

    def _read_header(self, cur: _Cursor) -> None:
        self.version = cur.unpack("<I")
        if self.version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.unpack("<I"))
        layouts = [self._tensor_layout(cur) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors = {
            name: GGUFTensorInfo(name, shape, ggml_type, data_start + offset, self._nbytes(name, shape, ggml_type))
            for name, shape, ggml_type, offset in layouts
        }

    def _tensor_layout(self, cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.string()
        ne = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        type_id = cur.unpack("<I")
        if type_id not in GGMLQuantizationType._value2member_map_:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} has quantization type {type_id}, which is unknown "
                                  f"(to the gguf package {_GGUF_VERSION}): a newer llama.cpp type?")  # fmt: skip
        offset = cur.unpack("<Q")
        return name, tuple(reversed(ne)), GGMLQuantizationType(type_id), offset

    def _nbytes(self, name: str, shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if shape and shape[-1] % block:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} of shape {shape} contradicts its type "
                                  f"{ggml_type.name}: rows are not whole {block}-value blocks")  # fmt: skip
        return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * type_size

    @property
    def architecture(self) -> str:
        if "general.architecture" not in self.metadata:
            raise GGUFFormatError(f"{self.path}: the metadata names no general.architecture")
        return self.metadata["general.architecture"]

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, shaped as ``gguf.quants.dequantize`` expects."""
        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = info.shape[-1] // block * type_size
        data = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return data.reshape(*info.shape[:-1], row_bytes)
