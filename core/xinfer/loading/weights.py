"""Checkpoint tensors into model parameters, by HF name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from xinfer.layers.linear import MergedLinear
from xinfer.model import CausalLM, ShardsCheckpoint, loader_of


class MissingWeightsError(ValueError):
    pass


def load_weights(model: CausalLM, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    loaders = model.checkpoint_loaders()
    loaded: set[str] = set()
    for name, tensor in weights:
        if any(name.endswith(ignored) for ignored in model.ignored_weights):
            continue
        if (prefix := loader_of(name, loaders)) is not None:
            parts = loaders[prefix].load_checkpoint(name[len(prefix) + 1 :], tensor)
            loaded |= {f"{prefix}.{part}" for part in parts}
            continue
        target, shard = _packed_target(name, model.packed_modules)
        if target not in params:
            continue  # a tensor this model does not use (e.g. an untied lm_head copy)
        param = params[target]
        owner, _, leaf = target.rpartition(".")
        module = modules[owner]
        if isinstance(module, ShardsCheckpoint):  # under tensor parallelism: this rank's part
            tensor = module.rank_part(leaf, shard, tensor)
        if shard is None:
            _copy(param.data, tensor, target)
        else:
            assert isinstance(module, MergedLinear)
            offset, size = module.shard_offset(shard)
            _copy(param.data[offset : offset + size], tensor, name)
        loaded.add(target if shard is None else f"{target}:{shard}")
    _check_complete(model, params, loaded)
    return loaded


def _packed_target(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    for part, (merged, shard) in packed.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{merged}."), shard
    return name, None


def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def _check_complete(model: CausalLM, params: Mapping[str, Tensor], loaded: set[str]) -> None:
    shard_names = {n.rsplit(":", 1)[0] for n in loaded if ":" in n}
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
        if isinstance(module, MergedLinear) and name in shard_names:
            expected = {f"{name}:{s}" for s in module.shard_sizes}
            missing += sorted(expected - loaded)
        elif id(param) not in loaded_ids:
            missing.append(name)
    if missing:
        shown = ", ".join(missing[:10]) + (f" and {len(missing) - 10} more" if len(missing) > 10 else "")
        raise MissingWeightsError(f"checkpoint lacks {len(missing)} weight(s) the model needs: {shown}")
