"""The Metal backend's kernels run on the CPU: each library's Metal source compiled as C++20
against a stand-in for the Metal standard library (metal_shim/metal_stdlib), one CPU thread
per GPU thread, and put where :class:`xinfer_metal.shaders.MetalLibrary` keeps its compiled
library. So the tests run the backend's real kernel source (its indexing, codecs, online
softmax, simdgroup merge) against the torch reference without a Mac; what they cannot show
is that Apple's compiler takes it, or its speed."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

from xinfer_metal.shaders import MetalLibrary

SHIM = Path(__file__).parent / "metal_shim"
COMPILER = shutil.which("g++")
BUILTINS = {"thread_position_in_grid", "threadgroup_position_in_grid", "thread_index_in_simdgroup",
            "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup"}  # fmt: skip


def launcher(kernel: str, arguments: str) -> str:
    """C++ calling ``kernel`` from an array of argument addresses and a thread's builtins."""
    passed = []
    for index, argument in enumerate(a.strip() for a in arguments.split(",")):
        builtin = re.fullmatch(r"(\w+)\s+\w+\s*\[\[(\w+)\]\]", argument)
        if builtin:
            kind, name = builtin.groups()
            assert name in BUILTINS, f"the emulator lacks the builtin {name}"
            value = f"b.{name}"
            passed.append(value if kind == "uint2" else f"{value}.x" if name.endswith("_grid") else value)
            continue
        typed = re.fullmatch(r"(.+?)\s*([*&])\s*\w+", argument, flags=re.DOTALL)
        assert typed, argument
        base = " ".join(w for w in typed.group(1).split() if w not in ("device", "constant"))
        passed.append(f"({base}*)args[{index}]" if typed.group(2) == "*" else f"*({base}*)args[{index}]")
    call = ", ".join(passed)
    return (f'extern "C" void launch_{kernel}(void** args, const unsigned long* threads, const unsigned long* group) '
            f"{{ metal::dispatch(threads, group, [&](const metal::Builtins& b) {{ {kernel}({call}); }}); }}\n")  # fmt: skip


def compile_library(library: MetalLibrary, build: Path) -> ctypes.CDLL:
    source = re.sub(r"//[^\n]*", "", library.source)
    launchers = [launcher(m[1], m[2]) for m in re.finditer(r"\bkernel\s+void\s+(\w+)\s*\(([^{]*)\)\s*\{", source)]
    path = build / ("_".join(Path(f).stem for f in library.files) + ".cpp")
    path.write_text(library.source + "\n" + "".join(launchers))
    shared = path.with_suffix(".so")
    assert COMPILER is not None
    subprocess.run([COMPILER, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wno-attributes", "-I", str(SHIM),
                    "-o", str(shared), str(path)], check=True)  # fmt: skip
    return ctypes.CDLL(str(shared))


class EmulatedLibrary:
    """A compiled library whose kernels run on CPU tensors, called as torch calls Metal kernels."""

    def __init__(self, library: MetalLibrary, build: Path):
        self.library, self.shared = library, compile_library(library, build)

    def __getattr__(self, kernel: str):
        function = getattr(self.shared, f"launch_{kernel}")

        def launch(*args: Any, threads: list[int], group_size: list[int]) -> None:
            values = [self._address(a) for a in args]
            addresses = (ctypes.c_void_p * len(values))(*(v[0] for v in values))
            dims = (ctypes.c_ulong * 2)(*threads), (ctypes.c_ulong * 2)(*group_size)
            function(addresses, *dims)

        launch.max_threads_per_threadgroup = 1024  # type: ignore[attr-defined]
        return launch

    @staticmethod
    def _address(value: Any) -> tuple[int, Any]:
        """Its address, and what keeps it alive."""
        if isinstance(value, torch.Tensor):
            assert value.device.type == "cpu" and value.is_contiguous()
            return value.data_ptr(), value
        scalar = ctypes.c_long(value) if isinstance(value, int) else ctypes.c_float(value)
        return ctypes.addressof(scalar), scalar
