"""In-situ quantization (``--isq``): a float checkpoint's weights quantized at load, into the same
packed formats GGUF files keep (their ``quantize``), so they run through the same kernels."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from tqdm import tqdm

from xinfer.quant.dispatch import replace_parameter
from xinfer.quant.tensor import QuantizedTensor, WeightFormat, get_weight_format, weight_formats


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


def quantize_weights(model: nn.Module, fmt: WeightFormat) -> int:
    """Quantize to ``fmt`` every float weight of ``model`` that its module declares may be quantized
    (``quantized_weights``: linear layers, embeddings, stacked experts) and whose rows are whole
    blocks; returns how many. Weights already packed stay as they are."""
    targets: dict[int, Tensor] = {}
    for module in model.modules():
        for name in getattr(module, "quantized_weights", ()):
            param = getattr(module, name, None)
            if (isinstance(param, Tensor) and not isinstance(param, QuantizedTensor) and param.dim() >= 2
                    and param.shape[-1] % fmt.block_values == 0):  # fmt: skip
                targets[id(param)] = param
    for param in tqdm(list(targets.values()), desc=f"Quantizing to {fmt.name}", unit="tensor"):
        raw = torch.cat([fmt.quantize(rows.float()) for rows in param.data.flatten(0, -2).split(4096)])
        packed = QuantizedTensor(raw.reshape(*param.shape[:-1], -1), fmt, param.shape)
        replace_parameter(model, param, packed)
    return len(targets)
