"""Metal kernels compiled at run time from the ``.metal`` sources in ``kernels/``
(``torch.mps.compile_shader``), and called by argument name.

torch binds a kernel's arguments by position: tensors as buffers, Python ints as 64-bit
and floats as 32-bit values. So a kernel takes tensors as ``device T*`` and scalars as
``constant long&`` or ``constant float&``, and the Python side never lists positions:
:meth:`MetalLibrary.launch` reads each kernel's arguments from its source
(:func:`parse_kernels`) and orders the named values by them, checking every name, tensor
dtype and scalar kind. A renamed argument therefore fails on the first launch, and CI,
which has no Mac, runs every launch against a recording library (tests/backends).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

ELEMENTS = {
    "float": torch.float32,
    "half": torch.float16,
    "bfloat": torch.bfloat16,
    "long": torch.int64,
    "int": torch.int32,
    "short": torch.int16,
    "ushort": torch.int16,  # raw 2-byte units: any 2-byte tensor viewed as int16
    "uchar": torch.uint8,
}
"""The torch dtype a tensor bound to ``device [const] T*`` must have, by ``T``."""
SCALARS: dict[str, type] = {"constant long&": int, "constant float&": float}
"""The Python type a scalar argument takes, by its Metal type (torch sends int as 64 bits, float as 32)."""

_POINTER = re.compile(r"device\s+(const\s+)?(\w+)\s*\*")


@dataclass(frozen=True)
class Param:
    """A kernel argument bound from Python: its name and Metal type (whitespace collapsed)."""

    name: str
    type: str

    @property
    def element(self) -> torch.dtype | None:
        """The dtype of a tensor argument (None: a scalar)."""
        match = _POINTER.fullmatch(self.type)
        return ELEMENTS.get(match.group(2)) if match else None

    def check(self, kernel: str, value: Any) -> None:
        """Raise TypeError unless ``value`` can be bound to this argument."""
        where = f"Metal kernel {kernel}, argument {self.name} ({self.type})"
        if self.element is not None:
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: expected a tensor, got {type(value).__name__}")
            if value.dtype != self.element or not value.is_contiguous():
                raise TypeError(f"{where}: expected a contiguous {self.element} tensor, got {value.dtype}")
        elif type(value) is not SCALARS[self.type]:
            raise TypeError(f"{where}: expected {SCALARS[self.type].__name__}, got {type(value).__name__}")


def parse_kernels(source: str) -> dict[str, tuple[Param, ...]]:
    """Each ``kernel void`` function of ``source`` and the arguments a caller binds, in
    order (those without an attribute: attributes mark the thread-position builtins)."""
    source = re.sub(r"//[^\n]*|/\*.*?\*/", "", source, flags=re.DOTALL)
    kernels = {}
    for match in re.finditer(r"\bkernel\s+void\s+(\w+)\s*\(", source):
        name, arguments = match.group(1), _enclosed(source, match.end())
        params = []
        for argument in (a.strip() for a in _split(arguments)):
            if "[[" in argument:
                continue
            typed = re.fullmatch(r"(.+?)\s*([*&])\s*(\w+)", argument, flags=re.DOTALL)
            if typed is None:
                raise ValueError(f"Metal kernel {name}: argument {argument!r} is neither device T* nor constant T&")
            param = Param(typed.group(3), " ".join(typed.group(1).split()) + typed.group(2))
            if param.element is None and param.type not in SCALARS:
                raise ValueError(f"Metal kernel {name}: argument {argument!r} has a type torch cannot bind "
                                 f"(tensors: device T* with T one of {', '.join(ELEMENTS)}; "
                                 f"scalars: {', '.join(SCALARS)})")  # fmt: skip
            params.append(param)
        kernels[name] = tuple(params)
    return kernels


def _enclosed(source: str, start: int) -> str:
    """The text from ``start`` to the parenthesis closing the one just before it."""
    depth = 1
    for end in range(start, len(source)):
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            return source[start:end]
    raise ValueError(f"unclosed argument list in Metal source: {source[start - 40 : start + 40]!r}")


def _split(arguments: str) -> list[str]:
    """Top-level comma-separated arguments (none of this project's attributes hold a comma)."""
    return [a for a in arguments.split(",") if a.strip()]


def compile_source(source: str) -> Any:
    """The library of ``source`` (tests put a recording library here)."""
    return torch.mps.compile_shader(source)


class MetalLibrary:
    """The kernels of some ``.metal`` files of ``xinfer_metal/kernels``, concatenated in the
    order given (shared helpers first), compiled on first launch."""

    def __init__(self, *files: str):
        self.files = files
        self.source = "\n".join(resources.files("xinfer_metal.kernels").joinpath(f).read_text() for f in files)
        self.kernels = parse_kernels(self.source)
        self.compiled: Any = None

    def launch(self, kernel: str, threads: list[int], group_size: list[int], **arguments: Any) -> None:
        """Run ``kernel`` over ``threads`` threads (per grid dimension) in threadgroups of
        ``group_size``, its arguments given by name."""
        getattr(self.library(), kernel)(*self.bind(kernel, arguments), threads=threads, group_size=group_size)

    def max_threads(self, kernel: str) -> int:
        """The most threads a threadgroup of ``kernel`` may have (Metal lowers it for kernels
        holding many registers)."""
        return int(getattr(self.library(), kernel).max_threads_per_threadgroup)

    def library(self) -> Any:
        if self.compiled is None:
            self.compiled = compile_source(self.source)
        return self.compiled

    def bind(self, kernel: str, arguments: dict[str, Any]) -> list[Any]:
        """``arguments`` in the order of the kernel's source, each checked against its type."""
        params = self.kernels[kernel]
        names = [p.name for p in params]
        missing = [n for n in names if n not in arguments]
        unknown = sorted(set(arguments) - set(names))
        if missing or unknown:
            wrong = [f"lacks {', '.join(missing)}"] * bool(missing) + [f"was given {', '.join(unknown)}"] * bool(
                unknown
            )
            raise TypeError(f"Metal kernel {kernel} {' and '.join(wrong)}: its source takes {', '.join(names)}")
        for param in params:
            param.check(kernel, arguments[param.name])
        return [arguments[n] for n in names]
