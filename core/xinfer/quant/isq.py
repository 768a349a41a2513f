"""In-situ quantization (``--isq``): a float checkpoint's weights quantized at load, into the same
packed formats GGUF files keep (their ``quantize``), so they run through the same kernels.

Each weight is quantized as soon as it is whole, so the float model is never all in memory: a model
built within :func:`quantizing_at_load` leaves the weights the format quantizes unallocated (on the
meta device); loading allocates each in float when its first tensor arrives (:meth:`LoadQuantizer.allocate`)
and packs it once every tensor that fills it is in (:meth:`LoadQuantizer.quantize`). Loading then holds
the packed weights so far and the float weights being filled: a tensor, a merged projection or a
layer's stacked experts.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from xinfer.quant.dispatch import replace_parameter
from xinfer.quant.tensor import QuantizedTensor, WeightFormat, get_weight_format, weight_formats

ROWS_AT_ONCE = 4096  # rows quantized per call: the float32 copy of a chunk, not of the whole weight


def isq_formats() -> list[str]:
    """The registered formats weights can be quantized to at load."""
    return sorted(name for name, fmt in weight_formats().items() if _quantizes(fmt))


def _quantizes(fmt: WeightFormat) -> bool:
    try:
        fmt.quantize(torch.zeros(1, fmt.block_values))
    except NotImplementedError:
        return False
    return True


def isq_format(name: str) -> WeightFormat:
    """The format ``--isq name`` quantizes to; an unknown one, or one without a quantizer, is one error."""
    known = isq_formats()
    if name not in known:
        raise ValueError(f"isq (--isq) {name!r} is not a format weights can be quantized to at load; "
                         f"choose one of {', '.join(known)}")  # fmt: skip
    return get_weight_format(name)


def quantizes(fmt: WeightFormat, module: nn.Module, name: str, param: object) -> bool:
    """Whether ``--isq`` to ``fmt`` packs ``param``, module ``module``'s parameter ``name``: a float weight its
    module declares may be quantized (``quantized_weights``: linear layers, embeddings, stacked experts)
    whose rows are whole blocks. Weights already packed stay as they are."""
    return (name in getattr(module, "quantized_weights", ()) and isinstance(param, Tensor)
            and not isinstance(param, QuantizedTensor) and param.dim() >= 2
            and param.shape[-1] % fmt.block_values == 0)  # fmt: skip


def packed(weight: Tensor, fmt: WeightFormat) -> QuantizedTensor:
    """``weight`` [..., N, K] quantized to ``fmt``."""
    rows = weight.data.flatten(0, -2).split(ROWS_AT_ONCE)
    raw = torch.cat([fmt.quantize(chunk.float()) for chunk in rows])
    return QuantizedTensor(raw.reshape(*weight.shape[:-1], -1), fmt, weight.shape)


class LoadQuantizer:
    """``--isq`` to ``fmt`` of a model loading onto ``device`` (see the module's docstring)."""

    def __init__(self, fmt: WeightFormat, device: torch.device):
        self.fmt, self.device = fmt, device
        # the weights it allocated, until it packs them (not held: one the checkpoint fills packed goes)
        self._filling: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    def targets(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        """The weights it packs in ``module`` and the modules under it, as (owner, name)."""
        return [(owner, name) for owner in module.modules() for name, param in owner.named_parameters(recurse=False)
                if quantizes(self.fmt, owner, name, param)]  # fmt: skip

    def allocate(self, model: nn.Module, module: nn.Module, name: str) -> None:
        """``module.name`` in float on the device, to be filled, where it was left unallocated (a tied weight
        is filled once: :mod:`xinfer.loading.tied`)."""
        param = getattr(module, name)
        if id(param) in self._filling or not param.is_meta:
            return
        allocated = replace_parameter(model, param, torch.empty(param.shape, dtype=param.dtype, device=self.device))
        self._filling[id(allocated)] = allocated

    def quantize(self, model: nn.Module, module: nn.Module, name: str) -> None:
        """``module.name`` packed, where ``fmt`` packs it and it has been allocated."""
        param = getattr(module, name)
        if id(param) not in self._filling or not quantizes(self.fmt, module, name, param):
            return
        del self._filling[id(param)]
        replace_parameter(model, param, packed(param, self.fmt))

    def leave_unallocated(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        """A parameter registration hook (``torch.nn.modules.module``): a weight ``fmt`` packs is put on the
        meta device as the model is built (by this thread: the hook is global)."""
        if param is None or param.is_meta or _loading.get() is not self or not quantizes(self.fmt, module, name, param):
            return None
        return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)


_loading: ContextVar[LoadQuantizer | None] = ContextVar("isq", default=None)


@contextlib.contextmanager
def quantizing_at_load(fmt: WeightFormat | None, device: torch.device) -> Iterator[None]:
    """Models built and loaded inside are quantized to ``fmt`` as their weights load (nothing if None)."""
    token = _loading.set(LoadQuantizer(fmt, device) if fmt is not None else None)
    try:
        yield
    finally:
        _loading.reset(token)


def load_quantizer() -> LoadQuantizer | None:
    """The quantizer of the model loading now (:func:`quantizing_at_load`); None without ``--isq``."""
    return _loading.get()


@contextlib.contextmanager
def unallocated_weights() -> Iterator[None]:
    """Within :func:`quantizing_at_load`, the weights its format packs are left on the meta device as
    modules register them; elsewhere nothing changes."""
    quantizer = load_quantizer()
    if quantizer is None:
        yield
        return
    # torch's annotation says the hook returns None; its docs and code take the new parameter it returns
    hook = torch.nn.modules.module.register_module_parameter_registration_hook(quantizer.leave_unallocated)  # type: ignore[arg-type]
    try:
        yield
    finally:
        hook.remove()
