"""Quantized weights: a tensor of packed bytes that knows its format, and the registry of formats.

A :class:`QuantizedTensor` is a ``uint8`` tensor holding a weight of logical shape ``[..., N, K]``
as its format stores it: each of the ``N`` rows is ``K / block_values`` blocks of
``block_bytes`` bytes, in order (for the GGUF formats, llama.cpp's block layout byte for byte).
It is a parameter like any other (counted in the model's bytes, moved with it), so a module
holds it where it held the float weight. ``xinfer.ops.linear`` and ``xinfer.ops.fused_moe``
dispatch on it (:mod:`xinfer.quant.dispatch`).

Formats register through the ``xinfer_weight_formats`` hook; the core's GGUF block formats
(:mod:`xinfer.quant.gguf_formats`) are registered the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor


class WeightFormat:
    """A block format of weights: ``block_values`` consecutive values of a row stored in
    ``block_bytes`` bytes. Subclasses define :meth:`dequantize` (and :meth:`quantize` where
    weights can be quantized to it at load: ``--isq``).

    ``kernels`` names, by backend name, "module:attribute" strings of a :class:`WeightKernels`
    for this format, which a backend runs in place of the reference (a backend may also
    declare kernels for formats itself: ``TorchOps.weight_kernels``).
    """

    name: str
    block_values: int
    block_bytes: int
    kernels: ClassVar[Mapping[str, str]] = {}
    fallback: ClassVar[str | None] = None  # the format ``--isq`` packs rows that are not whole blocks of this one in

    def dequantize(self, raw: Tensor) -> Tensor:
        """``raw`` uint8 [..., n * block_bytes] -> float32 [..., n * block_values]."""
        raise NotImplementedError

    def dequantize_rows(self, raw: Tensor, index: Tensor) -> Tensor:
        """The values of rows ``index`` (of the first dimension) of a weight stored as ``raw``."""
        return self.dequantize(raw[index])

    def quantize(self, values: Tensor) -> Tensor:
        """float [..., n * block_values] -> uint8 [..., n * block_bytes]."""
        raise NotImplementedError(f"weights cannot be quantized to {self.name} at load")

    def row_bytes(self, row_values: int) -> int:
        return row_values // self.block_values * self.block_bytes

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class QuantizedTensor(torch.Tensor):
    """Packed bytes [..., N, row_bytes] (uint8) of a weight of ``logical_shape`` [..., N, K] in
    ``format``. Torch functions see the bytes (a plain uint8 tensor comes out of any op on it);
    :meth:`dequantize` gives the values. ``parts``: where the rows of one merged weight are
    stored in different formats (a merged q/k/v whose v has a format of its own), the bytes are
    the parts' bytes one after the other (1-D), each from a multiple of :data:`PART_ALIGNMENT`,
    and ``parts`` views of them, in row order."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    format: WeightFormat
    logical_shape: torch.Size
    parts: tuple[QuantizedTensor, ...] | None

    @staticmethod
    def __new__(
        cls, raw: Tensor, format: WeightFormat, logical_shape: Sequence[int], parts: Sequence[QuantizedTensor] = ()
    ) -> QuantizedTensor:
        tensor = torch.Tensor._make_subclass(cls, raw, False)
        tensor.format, tensor.logical_shape = format, torch.Size(logical_shape)
        tensor.parts = tuple(parts) or None
        return tensor

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()

    @property
    def raw(self) -> Tensor:
        """The bytes as a plain tensor (what kernels read)."""
        return self.as_subclass(Tensor)

    def detach(self) -> QuantizedTensor:  # nn.Parameter detaches what it wraps
        return QuantizedTensor(self.raw.detach(), self.format, self.logical_shape, self.parts or ())

    def __deepcopy__(self, memo: dict) -> QuantizedTensor:
        if self.parts:  # (views of the bytes: made again over the copy)
            return cat_rows([part.__deepcopy__(memo) for part in self.parts])
        return QuantizedTensor(self.raw.clone(), self.format, self.logical_shape)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.parts:
            return cat_rows, (list(self.parts),)
        return QuantizedTensor, (self.raw.clone(), self.format, self.logical_shape)

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        formats = "+".join(p.format.name for p in self.parts) if self.parts else self.format.name
        return f"QuantizedTensor({formats}, shape={tuple(self.logical_shape)}, bytes={self.nbytes})"

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values, [*logical_shape] in ``dtype``."""
        if self.parts:
            return torch.cat([part.dequantize(dtype) for part in self.parts], dim=-2)
        return self.format.dequantize(self.raw).to(dtype)

    def to(self, *args: Any, **kwargs: Any) -> QuantizedTensor:
        """The weight on another device, still packed; a dtype is refused (:meth:`dequantize` casts)."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype not in (None, torch.uint8):
            raise TypeError(f"a {self.format.name} weight is packed bytes: dequantize(dtype) gives its values")
        if device is None or self.device == device:
            return self
        if self.parts:
            return cat_rows([part.to(device, non_blocking=non_blocking) for part in self.parts])
        return QuantizedTensor(self.raw.to(device, non_blocking=non_blocking), self.format, self.logical_shape)

    def cpu(self, *args: Any, **kwargs: Any) -> QuantizedTensor:
        return self.to("cpu")

    def cuda(self, device: Any = None, non_blocking: bool = False, **kwargs: Any) -> QuantizedTensor:  # type: ignore[override]
        return self.to(
            torch.device("cuda", device) if isinstance(device, int) else device or "cuda", non_blocking=non_blocking
        )

    def dequantize_rows(self, index: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """The values of rows ``index`` alone (an embedding lookup): [*index.shape, K] in ``dtype``."""
        if self.parts:
            return self.dequantize(dtype)[index]
        return self.format.dequantize_rows(self.raw, index).to(dtype)

    def select(self, index: int | Tensor) -> QuantizedTensor:  # type: ignore[override]
        """Entries of the first dimension (an expert of stacked experts, rows of an embedding table)."""
        assert not self.parts, "rows of a weight stored in parts are not selected"
        raw = self.raw[index]
        shape = (*raw.shape[:-1], self.logical_shape[-1])
        return QuantizedTensor(raw, self.format, shape)


class StackedRows(WeightFormat):
    """The format of a weight stored in parts (:attr:`QuantizedTensor.parts`)."""

    name = "parts"
    block_values = 1
    block_bytes = 0


_STACKED = StackedRows()
# where a part starts in a merged weight's bytes: kernels view a part's bytes as wider words
# (int32 codes, fp16 and fp32 scales), which torch refuses at an offset they do not divide
PART_ALIGNMENT = 16


def quantized(raw: Tensor, format: WeightFormat, logical_shape: Sequence[int], name: str = "") -> QuantizedTensor:
    """``raw`` as a weight of ``logical_shape`` in ``format``; a shape the bytes contradict is
    one error naming the tensor (``name``) and its format."""
    *outer, row = logical_shape
    where = f"tensor {name!r}: " if name else ""
    if row % format.block_values:
        raise ValueError(f"{where}rows of {row} values are not whole {format.name} blocks of {format.block_values}")
    expected = (*outer, format.row_bytes(row))
    if raw.dtype != torch.uint8 or tuple(raw.shape) != expected:
        raise ValueError(f"{where}{format.name} bytes of shape {tuple(raw.shape)} ({raw.dtype}) do not hold "
                         f"a weight of shape {tuple(logical_shape)}: expected uint8 {expected}")  # fmt: skip
    return QuantizedTensor(raw, format, logical_shape)


def cat_rows(tensors: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """The rows of ``tensors`` one after another (their last-but-one dimension), as one weight:
    their bytes concatenated where neighbours share a format, else in parts."""
    first = tensors[0]
    shape = (*first.logical_shape[:-2], sum(t.logical_shape[-2] for t in tensors), first.logical_shape[-1])
    flat = _joined_runs([p for t in tensors for p in (t.parts or (t,))])
    if len(flat) == 1:
        return flat[0]
    if len(shape) != 2:
        raise ValueError("stacked weights in different formats are not merged: dequantize them")
    starts, end = [], 0
    for p in flat:
        starts.append(-(-end // PART_ALIGNMENT) * PART_ALIGNMENT)
        end = starts[-1] + p.nbytes
    storage = first.raw.new_zeros(end)
    for p, start in zip(flat, starts):
        storage[start : start + p.nbytes] = p.raw.flatten()
    parts = [QuantizedTensor(storage[start : start + p.nbytes].view(p.raw.shape), p.format, p.logical_shape)
             for p, start in zip(flat, starts)]  # fmt: skip
    return QuantizedTensor(storage, _STACKED, shape, parts)


def _joined_runs(parts: list[QuantizedTensor]) -> list[QuantizedTensor]:
    """``parts`` with each run of neighbours in one format whose bytes are rows ([..., rows, bytes a row]) joined
    into one: one kernel call for them (a Q4_K_M file's q and k beside its Q6_K v)."""
    joined = [parts[0]]
    for p in parts[1:]:
        last = joined[-1]
        if p.format.name == last.format.name and _row_major(p) and _row_major(last):
            rows = last.logical_shape[-2] + p.logical_shape[-2]
            shape = (*last.logical_shape[:-2], rows, last.logical_shape[-1])
            joined[-1] = QuantizedTensor(torch.cat([last.raw, p.raw], dim=-2), last.format, shape)
        else:
            joined.append(p)
    return joined


def _row_major(tensor: QuantizedTensor) -> bool:
    return tuple(tensor.raw.shape[:-1]) == tuple(tensor.logical_shape[:-1])


def permute_rows(tensor: QuantizedTensor, convert: Any) -> QuantizedTensor | None:
    """``tensor`` with ``convert`` (a function of a weight) applied, where ``convert`` only reorders
    rows (as undoing a rotary layout does): found by converting a column of row numbers. None
    where it does more (the caller converts the dequantized values)."""
    if tensor.parts:
        return None
    rows = torch.arange(math.prod(tensor.logical_shape[:-1]), dtype=torch.float64)
    probe = rows.reshape(*tensor.logical_shape[:-1], 1)
    try:
        moved = convert(probe)
    except Exception:  # noqa: BLE001 - a conversion that cannot take the probe converts values instead
        return None
    if not isinstance(moved, Tensor) or moved.shape != probe.shape:
        return None
    order = moved.flatten()
    if not torch.equal(order.sort().values, rows):
        return None
    if torch.equal(order, rows):
        return tensor
    raw = tensor.raw.reshape(-1, tensor.raw.shape[-1])[order.long()].reshape(tensor.raw.shape)
    return QuantizedTensor(raw, tensor.format, tensor.logical_shape)


class WeightKernels:
    """What a backend runs for one weight format, each optional (None: the reference):

    - ``linear(x, weight, bias) -> Tensor``: ``x`` [T, K] @ weight.T (+ bias), in ``x``'s dtype;
    - ``norm_linear(x, residual, norm_weight, eps, weight, bias) -> (y, normed, h)``: as
      :meth:`xinfer.ops.Ops.norm_linear` (a kernel may prepare the activations in the norm's pass);
    - ``fused_moe(x, w13, w2, topk_weights, topk_ids, activation) -> Tensor``: as
      :meth:`xinfer.ops.Ops.fused_moe`, called where ``w13`` and ``w2`` both have this format;
    - ``prepare(weight) -> QuantizedTensor``: a one-time repack at load into the layout the
      kernels read (a format of the backend's own, whose ``dequantize`` still gives the values);
    - ``prepare_rows(weight) -> QuantizedTensor``: ``prepare`` for a weight whose rows are also
      looked up (an embedding table tied to the LM head): the repacked format's ``dequantize_rows``
      reads rows fast. Without it such a weight is left as it is.
    """

    linear: Any = None
    norm_linear: Any = None
    fused_moe: Any = None
    prepare: Any = None
    prepare_rows: Any = None


_loaded: list[tuple[Any, dict[str, WeightFormat]]] = []  # (the discovery, its formats)


def divide(x: Tensor, divisor: float) -> Tensor:
    """``x / divisor``, rounded alike on every device, as quantizers must be (``--isq`` packs the same
    codes on a GPU as on the CPU): CUDA divides by a Python number as a multiplication by its
    reciprocal, which for most divisors differs from the quotient in the last bit."""
    return x / torch.tensor(divisor, dtype=x.dtype, device=x.device)


def weight_formats() -> dict[str, WeightFormat]:
    """The formats registered through ``xinfer_weight_formats``, by name (loaded once per plugin discovery)."""
    from xinfer import registry

    found = registry.discovery()
    if not _loaded or _loaded[0][0] is not found:
        _loaded[:] = [(found, registry.weight_formats())]
    return _loaded[0][1]


def get_weight_format(name: str) -> WeightFormat:
    formats = weight_formats()
    if name not in formats:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(sorted(formats))}")
    return formats[name]
