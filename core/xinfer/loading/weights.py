"""Checkpoint tensors into model parameters, by HF name.

A quantized checkpoint tensor (:class:`xinfer.quant.QuantizedTensor`) becomes the parameter itself
where its module declares the parameter may be quantized (``quantized_weights``); the shards of a
merged projection are merged packed once all have arrived. Anywhere else it is dequantized.

With ``--isq`` (:mod:`xinfer.quant.isq`) a weight left unallocated is allocated when its first tensor
arrives and quantized once it is whole: a tensor, every shard of a merged projection, every part a
checkpoint-loading module (experts) takes.

A parameter under several names (tied embeddings and LM head) is filled as transformers fills it, whatever the
order of its tensors in the files (:mod:`xinfer.loading.tied`)."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from xinfer.distributed.group import current
from xinfer.layers.linear import MergedLinear
from xinfer.loading.stored import StoredTensor, Weights, part_of, whole
from xinfer.loading.tied import tied_as_transformers
from xinfer.model import CausalLM, ShardsCheckpoint, loader_of
from xinfer.quant import QuantizedTensor, cat_rows
from xinfer.quant.dispatch import replace_parameter
from xinfer.quant.isq import load_quantizer

log = logging.getLogger(__name__)


class MissingWeightsError(ValueError):
    pass


def load_weights(model: CausalLM, weights: Weights) -> set[str]:
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    modules = dict(model.named_modules())
    loaders = model.checkpoint_loaders()
    loaded: set[str] = set()
    packed_shards: dict[str, dict[str, QuantizedTensor]] = {}  # merged weight -> its quantized shards so far
    float_merged: set[str] = set()  # merged weights with a float shard: all merge as floats
    split = current().size > 1  # under tensor parallelism a rank reads its slice of each split tensor
    isq = load_quantizer()
    unfilled = {prefix: loader.checkpoint_parts() for prefix, loader in loaders.items()} if isq else {}
    unused: list[str] = []
    for name, stored in tied_as_transformers(model, weights):
        if any(name.endswith(ignored) for ignored in model.ignored_weights):
            continue
        if (prefix := loader_of(name, loaders)) is not None:
            loader = loaders[prefix]
            if isinstance(stored, QuantizedTensor) and not getattr(loader, "quantized_weights", ()):
                stored = stored.dequantize()
            targets = isq.targets(modules[prefix]) if isq else []
            if isq:  # the module's weights to quantize, until every part it loads is in
                for module, leaf in targets:
                    isq.allocate(model, module, leaf)
            parts = loader.load_checkpoint(name[len(prefix) + 1 :], stored)
            loaded |= {f"{prefix}.{part}" for part in parts}
            if isq:
                unfilled[prefix] -= parts
                if not unfilled[prefix]:
                    for module, leaf in targets:
                        isq.quantize(model, module, leaf)
            continue
        target, shard = _packed_target(name, model.packed_modules)
        if target not in params:
            if _numel(stored):  # never read (an empty one is a module transformers builds at size 0)
                unused.append(name)
            continue
        owner, _, leaf = target.rpartition(".")
        module = modules[owner]
        if isq:
            isq.allocate(model, module, leaf)
        param = getattr(module, leaf)
        if isinstance(stored, QuantizedTensor) and (leaf not in getattr(module, "quantized_weights", ()) or split):
            stored = stored.dequantize()  # packed blocks are not split over ranks: a rank's part runs as floats
        if split and isinstance(module, ShardsCheckpoint):  # under tensor parallelism: this rank's slice
            tensor = part_of(stored, module.rank_slice(leaf, shard, stored.shape))
        else:
            tensor = whole(stored)
        if shard is None:
            if isinstance(tensor, QuantizedTensor):
                _replace(model, param, tensor, target)
            else:
                _copy(param.data, tensor, target)
        else:
            assert isinstance(module, MergedLinear)
            offset, size = module.shard_offset(shard)
            if isinstance(tensor, QuantizedTensor) and target not in float_merged:
                _check_shape(tensor.logical_shape, (size, param.shape[1]), name)
                packed_shards.setdefault(target, {})[shard] = tensor
                if len(packed_shards[target]) == len(module.shard_sizes):
                    shards = packed_shards.pop(target)
                    _replace(model, param, cat_rows([shards[s] for s in module.shard_sizes]), target)
            else:
                float_merged.add(target)
                for other, values in packed_shards.pop(target, {}).items():  # a float shard: merge as floats
                    start, rows = module.shard_offset(other)
                    _copy(param.data[start : start + rows], values.dequantize(), other)
                if isinstance(tensor, QuantizedTensor):
                    tensor = tensor.dequantize()
                _copy(param.data[offset : offset + size], tensor, name)
        loaded.add(target if shard is None else f"{target}:{shard}")
        if isq and (shard is None or all(f"{target}:{s}" in loaded for s in module.shards_of(leaf))):
            isq.quantize(model, module, leaf)  # whole: every shard of a merged projection is in
    for target, shards in packed_shards.items():  # incomplete: what arrived, as floats
        owner, _, leaf = target.rpartition(".")
        module = modules[owner]
        assert isinstance(module, MergedLinear)
        for shard, values in shards.items():
            start, rows = module.shard_offset(shard)
            _copy(getattr(module, leaf).data[start : start + rows], values.dequantize(), f"{target}:{shard}")
    _check_complete(model, loaded, unused)
    _report_unused(unused)
    return loaded


def _numel(stored: Tensor | StoredTensor | QuantizedTensor) -> int:
    return math.prod(stored.logical_shape if isinstance(stored, QuantizedTensor) else stored.shape)


def _report_unused(names: list[str]) -> None:
    """One line naming the checkpoint tensors no parameter took, by pattern, as transformers reports them: a
    field the model ignores, or one it should read and does not."""
    if names:
        log.info("%d checkpoint tensor(s) not used by the model: %s", len(names), _patterns(names))


def _patterns(names: list[str]) -> str:
    """``names`` by pattern (layer indexes as ``*``), the first 8."""
    patterns = sorted({re.sub(r"\.\d+\.", ".*.", name) for name in names})
    return ", ".join(patterns[:8]) + (f" and {len(patterns) - 8} more" if len(patterns) > 8 else "")


def _replace(model: CausalLM, param: nn.Parameter, tensor: QuantizedTensor, name: str) -> None:
    """``param`` (under every name tied to it) becomes the quantized ``tensor``."""
    _check_shape(tensor.logical_shape, param.shape, name)
    replace_parameter(model, param, tensor.to(param.device))


def _check_shape(got: Sequence[int], expected: Sequence[int], name: str) -> None:
    if tuple(got) != tuple(expected):
        raise ValueError(f"weight {name}: checkpoint shape {tuple(got)} != model shape {tuple(expected)}")


def _packed_target(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for part, (merged, shard) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{merged}."), shard
    return name, None


def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    _check_shape(src.shape, dst.shape, name)
    with torch.no_grad():
        dst.copy_(src)


def _checkpoint_name(model: CausalLM, merged: str, shard: str) -> str:
    """The checkpoint's name of shard ``shard`` of the merged weight ``merged`` (``...qkv_proj.weight``, "k":
    ``...k_proj.weight``)."""
    for part, (module, each) in model.packed_modules.items():
        if each == shard and f".{module}." in merged:
            return merged.replace(f".{module}.", f".{part}.")
    return f"{merged}:{shard}"


def _check_complete(model: CausalLM, loaded: set[str], unused: list[str]) -> None:
    """Every parameter loaded, else one error naming the missing ones, and the checkpoint's tensors no
    parameter took (``unused``: the missing ones under other names, say without the ``model.`` prefix)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[n]) for n in loaded if n in params}
    modules = dict(model.named_modules())
    loaders = model.checkpoint_loaders()
    missing = sorted(
        f"{p}.{part}" for p, m in loaders.items() for part in m.checkpoint_parts() if f"{p}.{part}" not in loaded
    )
    for name, param in model.named_parameters():
        module = modules.get(name.rsplit(".", 1)[0])
        if loader_of(name, loaders) is not None:
            continue
        if id(param) in loaded_ids:  # whole
            continue
        if isinstance(module, MergedLinear):  # by its shards, the checkpoint's tensors
            shards = module.shards_of(name.rsplit(".", 1)[1])
            missing += sorted(_checkpoint_name(model, name, s) for s in shards if f"{name}:{s}" not in loaded)
        else:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        hint = ""
        if "lm_head.weight" in missing and getattr(model.config, "tie_word_embeddings", None) is False:
            hint = " (config.json sets tie_word_embeddings false: if the LM head is the input embeddings, set it true)"
        if unused:
            hint += f"; it has {len(unused)} tensor(s) the model does not read: {_patterns(unused)}"
        raise MissingWeightsError(f"checkpoint lacks {len(missing)} weight(s) the model needs: {shown}{hint}")
