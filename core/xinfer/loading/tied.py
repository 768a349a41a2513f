"""Tied weights (one parameter under several names: the LM head and the input embeddings where the config sets
``tie_word_embeddings``) filled as transformers' ``from_pretrained`` fills them: it reads the checkpoint untied,
then ties (``PreTrainedModel.tie_weights``). A checkpoint holding one of the names fills the shared parameter,
whichever it is (the embeddings take a lone ``lm_head.weight``); one holding both with equal values keeps them
tied; one holding both with different values unties them, each name keeping its own values (transformers warns
that the config is wrong). So that neither file order nor sharding decides, the tensors under a parameter's
other names are held back until the whole checkpoint has been read."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from xinfer.loading.stored import StoredTensor, Weights, whole
from xinfer.quant import QuantizedTensor

log = logging.getLogger(__name__)

Stored = Tensor | StoredTensor


@dataclass(frozen=True)
class _Tie:
    """A parameter's other name ``alias``, tied to ``name`` (its first); the parameter's shape, dtype and device as
    the model was built."""

    alias: str
    name: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


def tied_as_transformers(model: nn.Module, weights: Weights) -> Iterator[tuple[str, Stored]]:
    """``weights`` with the tensors of tied names resolved as transformers resolves them (see the module's
    docstring); a pair that differs is untied in ``model`` before the second tensor is yielded."""
    ties = {tie.alias: tie for tie in _ties(model)}
    firsts = {tie.name for tie in ties.values()}
    held: dict[str, Stored] = {}
    # a first name's tensor where it can be read again; one read already (a GGUF file's) is not kept alive
    # for the whole load: the parameter it filled holds its values
    seen: dict[str, StoredTensor | None] = {}
    for name, stored in weights:
        if name in ties:
            held[name] = stored
            continue
        if name in firsts:
            seen[name] = stored if isinstance(stored, StoredTensor) else None
        yield name, stored
    for alias, stored in held.items():
        tie = ties[alias]
        if tie.name not in seen:
            yield tie.name, stored
            continue
        first = seen[tie.name]
        if not _differ(stored, model.get_parameter(tie.name) if first is None else first, tie.dtype):
            log.debug("%s: the checkpoint's copy equals %s, tied to it", alias, tie.name)
            continue
        log.warning(
            "the config ties %s to %s (tie_word_embeddings), but the checkpoint holds both with different values: "
            "they are not tied, each takes its own, as transformers loads them",
            tie.alias, tie.name,
        )  # fmt: skip
        _untie(model, tie)
        yield alias, stored


def _ties(model: nn.Module) -> list[_Tie]:
    """Each name of a parameter after its first (the name it is registered under first)."""
    first: dict[int, str] = {}
    ties = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in first:
            first[id(param)] = name
        else:
            ties.append(_Tie(name, first[id(param)], param.shape, param.dtype, param.device))
    return ties


def _differ(a: Stored, b: Stored, dtype: torch.dtype) -> bool:
    """Whether two checkpoint tensors differ in ``dtype``, as transformers compares the parameters it loaded them
    into. From the files' headers alone (on the meta device: the fit check's model) their values are unknown: taken
    as the same, as the copies a tied checkpoint holds usually are."""
    if _shape(a) != _shape(b):
        return True
    if _on_meta(a) or _on_meta(b):
        return False
    return not torch.equal(_values(a, dtype), _values(b, dtype))


def _shape(stored: Stored) -> torch.Size:
    return stored.logical_shape if isinstance(stored, QuantizedTensor) else stored.shape


def _on_meta(stored: Stored) -> bool:
    return isinstance(stored, Tensor) and stored.is_meta


def _values(stored: Stored, dtype: torch.dtype) -> Tensor:
    return stored.dequantize(dtype) if isinstance(stored, QuantizedTensor) else whole(stored).to(dtype)


def _untie(model: nn.Module, tie: _Tie) -> None:
    """``tie.alias`` a parameter of its own, built like the shared one (left on the meta device where
    ``--isq`` left that unallocated: loading allocates it)."""
    owner, _, leaf = tie.alias.rpartition(".")
    weight = torch.empty(tie.shape, dtype=tie.dtype, device=tie.device)
    setattr(model.get_submodule(owner), leaf, nn.Parameter(weight, requires_grad=False))
