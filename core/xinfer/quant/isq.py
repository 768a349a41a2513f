"""In-situ quantization (``--isq``): a float checkpoint's weights quantized at load, into the same
packed formats GGUF files keep (their ``quantize``), so they run through the same kernels.

``--isq w2`` is xInfer's 2-bit mode for MoE models: the routed experts' stacked weights alone, in Q2_K (2.625 bits a
value), those a checkpoint already packs in another format (MXFP4, a GGUF file's types) re-packed, an expert at a
time, once loaded; every other weight stays as the checkpoint has it.

Each weight is quantized as soon as it is whole, so the float model is never all in memory: a model
built within :func:`quantizing_at_load` leaves the weights the format quantizes unallocated (on the
meta device); loading allocates each in float when its first tensor arrives (:meth:`LoadQuantizer.allocate`)
and packs it once every tensor that fills it is in (:meth:`LoadQuantizer.quantize`). Loading then holds
the packed weights so far and the float weights being filled: a tensor, a merged projection or a
layer's stacked experts.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from xinfer.quant.dispatch import replace_parameter
from xinfer.quant.tensor import QuantizedTensor, WeightFormat, get_weight_format, weight_formats

log = logging.getLogger("xinfer")
ROWS_AT_ONCE = 4096  # rows quantized per call: the float32 copy of a chunk, not of the whole weight


EXPERT_MODES = {"w2": "q2_k"}  # the modes that pack the routed experts alone, and into which format


@dataclass(frozen=True)
class IsqMode:
    """What ``--isq`` packs, into ``fmt``: every float weight a module declares quantizable, or with
    ``experts_only`` the routed experts' stacked weights alone (packed ones in another format too)."""

    name: str  # what --isq was given
    fmt: WeightFormat
    experts_only: bool = False

    def format_for(self, module: nn.Module, name: str, param: object) -> WeightFormat | None:
        """The format module ``module``'s parameter ``name`` is packed in, or None: a weight its module declares may
        be quantized (``quantized_weights``: linear layers, embeddings, stacked experts), float, or with
        ``experts_only`` a stacked experts' one (3-D) not yet in ``fmt``; in ``fmt``, or where its rows are not
        whole blocks of ``fmt``, in ``fmt.fallback`` (None where they are not whole blocks of that either)."""
        if name not in getattr(module, "quantized_weights", ()) or not isinstance(param, Tensor):
            return None
        packed_in = param.format if isinstance(param, QuantizedTensor) else None
        shape = param.logical_shape if isinstance(param, QuantizedTensor) else param.shape
        if self.experts_only:
            if len(shape) != 3 or packed_in is self.fmt:
                return None
        elif len(shape) < 2 or packed_in is not None:
            return None
        return next((fmt for fmt in self.formats if shape[-1] % fmt.block_values == 0), None)

    @property
    def formats(self) -> list[WeightFormat]:
        """``fmt``, then its fallback where it has one."""
        return [self.fmt, *([get_weight_format(self.fmt.fallback)] if self.fmt.fallback else [])]


def isq_formats() -> list[str]:
    """The registered formats weights can be quantized to at load."""
    return sorted(name for name, fmt in weight_formats().items() if _quantizes(fmt))


def isq_names() -> list[str]:
    """What ``--isq`` takes: :func:`isq_formats` and the experts' modes."""
    return isq_formats() + sorted(EXPERT_MODES)


def _quantizes(fmt: WeightFormat) -> bool:
    try:
        fmt.quantize(torch.zeros(1, fmt.block_values))
    except NotImplementedError:
        return False
    return True


def isq_mode(name: str) -> IsqMode:
    """What ``--isq name`` packs; an unknown name, or a format without a quantizer, is one error."""
    known = isq_names()
    if name not in known:
        raise ValueError(f"isq (--isq) {name!r} is not a format weights can be quantized to at load; "
                         f"choose one of {', '.join(known)}")  # fmt: skip
    if name in EXPERT_MODES:
        return IsqMode(name, get_weight_format(EXPERT_MODES[name]), experts_only=True)
    return IsqMode(name, get_weight_format(name))


def packed(weight: Tensor, fmt: WeightFormat) -> QuantizedTensor:
    """``weight`` [..., N, K], float or packed in another format, quantized to ``fmt``."""
    shape = weight.logical_shape if isinstance(weight, QuantizedTensor) else weight.shape
    raw = torch.cat([fmt.quantize(rows.float()) for rows in _row_chunks(weight)])
    return QuantizedTensor(raw.reshape(*shape[:-1], -1), fmt, shape)


def _row_chunks(weight: Tensor) -> Iterator[Tensor]:
    """``weight``'s rows [rows, K], up to :data:`ROWS_AT_ONCE` at a time (a packed one decoded an expert at a time:
    the float copy is of one chunk, not of the whole weight)."""
    if not isinstance(weight, QuantizedTensor):
        yield from weight.data.flatten(0, -2).split(ROWS_AT_ONCE)
    elif len(weight.logical_shape) == 3:
        for expert in range(weight.logical_shape[0]):
            yield from weight.select(expert).dequantize().split(ROWS_AT_ONCE)
    else:
        yield from weight.dequantize().split(ROWS_AT_ONCE)


class LoadQuantizer:
    """``--isq`` in ``mode`` of a model loading onto ``device`` (see the module's docstring)."""

    def __init__(self, mode: IsqMode, device: torch.device):
        self.mode, self.device = mode, device
        self.fallbacks = 0  # weights packed in the mode's format's fallback
        self._packed: set[int] = set()  # ids of the weights it packed
        # the weights it allocated, until it packs them (not held: one the checkpoint fills packed goes)
        self._filling: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()

    def targets(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        """The weights it packs in ``module`` and the modules under it, as (owner, name)."""
        return [(owner, name) for owner in module.modules() for name, param in owner.named_parameters(recurse=False)
                if self.mode.format_for(owner, name, param)]  # fmt: skip

    def allocate(self, model: nn.Module, module: nn.Module, name: str) -> None:
        """``module.name`` in float on the device, to be filled, where it was left unallocated (a tied weight
        is filled once: :mod:`xinfer.loading.tied`)."""
        param = getattr(module, name)
        if id(param) in self._filling or not param.is_meta or isinstance(param, QuantizedTensor):
            return  # (a packed one on the meta device: the fit check's model, loaded from the files' headers)
        allocated = replace_parameter(model, param, torch.empty(param.shape, dtype=param.dtype, device=self.device))
        self._filling[id(allocated)] = allocated

    def quantize(self, model: nn.Module, module: nn.Module, name: str) -> None:
        """``module.name`` packed, where the mode packs it and it has been allocated."""
        param = getattr(module, name)
        fmt = self.mode.format_for(module, name, param)
        if id(param) not in self._filling or fmt is None:
            return
        del self._filling[id(param)]
        self._packed.add(id(replace_parameter(model, param, packed(param, fmt))))
        self.fallbacks += fmt is not self.mode.fmt

    def finish(self, model: nn.Module) -> None:
        """Once the model is loaded: the weights loading left packed in another format that the mode packs
        (``--isq w2``'s experts of an MXFP4 checkpoint or a GGUF file) packed again, a line on the weights
        packed in the fallback format, and a warning naming the formats of those the checkpoint held packed, which
        a mode of every weight leaves as they are (a GGUF file's)."""
        for module, name in self.targets(model):
            param = getattr(module, name)
            if isinstance(param, QuantizedTensor) and (fmt := self.mode.format_for(module, name, param)):
                self._packed.add(id(replace_parameter(model, param, packed(param, fmt))))
                self.fallbacks += fmt is not self.mode.fmt
        if self.fallbacks:
            log.info("--isq: %d weights whose rows are not whole blocks of %d values are in %s", self.fallbacks,
                     self.mode.fmt.block_values, self.mode.fmt.fallback)  # fmt: skip
        if unfit := self._left_float(model):
            sizes = " or ".join(str(fmt.block_values) for fmt in self.mode.formats)
            log.warning("--isq %s: %d weights stay float, their rows not whole blocks of %s values (%s%s)",
                        self.mode.name, len(unfit), sizes, ", ".join(unfit[:3]), ", ..." if len(unfit) > 3 else "")  # fmt: skip
        if self.mode.experts_only and not self._has_experts(model):
            log.warning("--isq %s packs the routed experts alone: this model has none, so no weight is packed",
                        self.mode.name)  # fmt: skip
        kept = sorted(
            {part.format.name for param in self._packed_by_checkpoint(model) for part in param.parts or [param]}
        )
        if kept:
            log.warning("--isq %s: the weights the checkpoint holds packed (%s) stay as they are: --isq packs float "
                        "weights", self.mode.name, ", ".join(kept))  # fmt: skip

    @staticmethod
    def _has_experts(model: nn.Module) -> bool:
        """Whether ``model`` has stacked experts' weights (3-D, float or packed)."""
        return any(len(param.logical_shape if isinstance(param, QuantizedTensor) else param.shape) == 3
                   for module in model.modules() for name, param in module.named_parameters(recurse=False)
                   if name in getattr(module, "quantized_weights", ()))  # fmt: skip

    def _left_float(self, model: nn.Module) -> list[str]:
        """The float weights the mode would pack but for their rows, which are whole blocks of no format of it."""
        rank = 3 if self.mode.experts_only else 2
        return [f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
                for name, param in module.named_parameters(recurse=False)
                if name in getattr(module, "quantized_weights", ()) and not isinstance(param, QuantizedTensor)
                and param.dim() >= rank and self.mode.format_for(module, name, param) is None]  # fmt: skip

    def _packed_by_checkpoint(self, model: nn.Module) -> list[QuantizedTensor]:
        """The quantizable weights the checkpoint held packed and a mode of every weight left so."""
        if self.mode.experts_only:
            return []
        return [param for module in model.modules() for name, param in module.named_parameters(recurse=False)
                if name in getattr(module, "quantized_weights", ()) and isinstance(param, QuantizedTensor)
                and id(param) not in self._packed]  # fmt: skip

    def leave_unallocated(self, module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        """A parameter registration hook (``torch.nn.modules.module``): a weight the mode packs is put on the
        meta device as the model is built (by this thread: the hook is global)."""
        if (
            param is None
            or param.is_meta
            or _loading.get() is not self
            or self.mode.format_for(module, name, param) is None
        ):
            return None
        return nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)


_loading: ContextVar[LoadQuantizer | None] = ContextVar("isq", default=None)


@contextlib.contextmanager
def quantizing_at_load(mode: IsqMode | None, device: torch.device) -> Iterator[None]:
    """Models built and loaded inside are quantized in ``mode`` as their weights load (nothing if None)."""
    token = _loading.set(LoadQuantizer(mode, device) if mode is not None else None)
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
