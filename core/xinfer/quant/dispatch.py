"""How ops run quantized weights: the backend's kernel for the weight's format where it has one,
else the reference, which dequantizes per call (correct on every backend, slow).

A backend declares the formats it runs natively in ``weight_kernels`` (format name ->
"module:attribute" of a :class:`~xinfer.quant.WeightKernels`); a format may also name kernels by
backend name (``WeightFormat.kernels``), which win, as a plugin op's kernels do.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from xinfer import registry
from xinfer.quant.tensor import QuantizedTensor, WeightKernels, cat_rows

# by backend, by format name; a plain dict (a backend is kept for the process): every linear looks up here
_resolved: dict[Any, dict[str, WeightKernels | None]] = {}


def kernels_for(backend: Any, format_name: str, format_kernels: Any = None) -> WeightKernels | None:
    """The kernels ``backend`` runs for the format named ``format_name``; None: the reference only."""
    cache = _resolved.get(backend)
    if cache is None:  # (not setdefault: a dict made per call otherwise, every linear)
        cache = _resolved[backend] = {}
    if format_name not in cache:
        ref = dict(format_kernels or {}).get(backend.name) or dict(getattr(backend, "weight_kernels", {})).get(
            format_name
        )
        loaded = registry.load_object(ref) if ref else None
        cache[format_name] = loaded() if isinstance(loaded, type) else loaded
    return cache[format_name]


def _kernels(backend: Any, weight: QuantizedTensor) -> WeightKernels | None:
    return kernels_for(backend, weight.format.name, weight.format.kernels)


def linear(backend: Any, x: Tensor, weight: QuantizedTensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` for a quantized ``weight`` [N, K]."""
    if weight.parts:
        out = torch.cat([linear(backend, x, part, None) for part in weight.parts], dim=-1)
        return out if bias is None else out + bias
    kernels = _kernels(backend, weight)
    if kernels is not None and kernels.linear is not None:
        return kernels.linear(x, weight, bias)
    return backend.linear(x, weight.dequantize(x.dtype), bias)


def norm_linear(
    backend: Any,
    x: Tensor,
    residual: Tensor | None,
    norm_weight: Tensor,
    eps: float,
    weight: QuantizedTensor,
    bias: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """:meth:`xinfer.ops.Ops.norm_linear` for a quantized ``weight``: the format's kernel where it has one (a weight
    in parts: its first part's, the other parts then multiplying the normed rows), else the backend's norm, then
    :func:`linear`."""
    first = weight.parts[0] if weight.parts else weight
    kernels = _kernels(backend, first)
    if kernels is not None and kernels.norm_linear is not None:
        if not weight.parts:
            return kernels.norm_linear(x, residual, norm_weight, eps, weight, bias)
        y, normed, h = kernels.norm_linear(x, residual, norm_weight, eps, first, None)
        out = torch.cat([y, *(linear(backend, normed, part, None) for part in weight.parts[1:])], dim=-1)
        return (out if bias is None else out + bias), normed, h
    if residual is None:
        normed, h = backend.rms_norm(x, norm_weight, eps), x
    else:
        normed, h = backend.rms_norm(x, norm_weight, eps, residual)
    return linear(backend, normed, weight, bias), normed, h


def fused_moe(
    backend: Any, x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, activation: str,
    limit: float | None = None,
) -> Tensor:  # fmt: skip
    """:meth:`xinfer.ops.Ops.fused_moe` where ``w13`` or ``w2`` is quantized: the format's kernel
    where both share a format that has one (and no clamp is asked for), else the backend's float MoE
    over the experts dequantized for this call (no host sync: it runs inside captured steps too)."""
    if isinstance(w13, QuantizedTensor) and isinstance(w2, QuantizedTensor) and w13.format.name == w2.format.name:
        kernels = _kernels(backend, w13) if limit is None else None
        if kernels is not None and kernels.fused_moe is not None:
            return kernels.fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
    w13, w2 = (w.dequantize(x.dtype) if isinstance(w, QuantizedTensor) else w for w in (w13, w2))
    if limit is None:
        return backend.fused_moe(x, w13, w2, topk_weights, topk_ids, activation)
    return backend.fused_moe(x, w13, w2, topk_weights, topk_ids, activation, limit)


def prepare_weights(model: nn.Module, backend: Any) -> None:
    """Repack, once, every quantized weight of ``model`` whose format's kernels on ``backend``
    read a layout of their own (``WeightKernels.prepare``)."""
    looked_up = {id(p) for m in model.modules() if getattr(m, "looks_up_rows", False) for p in m.parameters()}
    seen: set[int] = set()
    for module in model.modules():
        for param in list(module.parameters(recurse=False)):
            if isinstance(param, QuantizedTensor) and id(param) not in seen:
                seen.add(id(param))
                prepared = _prepared(backend, param, id(param) in looked_up)
                if prepared is not param:
                    replace_parameter(model, param, prepared)


def _prepared(backend: Any, weight: QuantizedTensor, looked_up: bool) -> QuantizedTensor:
    if weight.parts:
        parts = [_prepared(backend, part, looked_up) for part in weight.parts]
        return weight if all(p is q for p, q in zip(parts, weight.parts)) else cat_rows(parts)
    kernels = _kernels(backend, weight)
    prepare = None if kernels is None else kernels.prepare_rows if looked_up else kernels.prepare
    return weight if prepare is None else prepare(weight)


def replace_parameter(model: nn.Module, old: Tensor, new: Tensor) -> nn.Parameter:
    """Every module's parameter that is ``old`` (tied weights are one parameter under several
    names) becomes ``new``; returns the parameter they now hold."""
    parameter = nn.Parameter(new, requires_grad=False)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param is old:
                setattr(module, name, parameter)
    return parameter
