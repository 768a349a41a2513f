"""The base of every architecture a plugin provides."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from xinfer.distributed.group import Slice
from xinfer.loading.stored import StoredTensor, Weights

HF_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
"""The usual HF checkpoint projections, stored as merged ``qkv_proj`` / ``gate_up_proj``."""


@runtime_checkable
class ConvertsCheckpoint(Protocol):
    """A module whose parameters differ from the checkpoint's by a fixed conversion (an
    offset on norm weights, reordered rows...). Under tensor parallelism a split tensor is converted
    after its slice is read: the conversion treats the rows (or heads) it is given alike."""

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        """The value to load of checkpoint tensor ``name`` (relative to this module)."""
        ...


@runtime_checkable
class ShardsCheckpoint(Protocol):
    """A module split under tensor parallelism: it holds a part of some checkpoint tensors."""

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        """The slice this rank keeps of the checkpoint tensor of ``shape`` for parameter ``name`` (of this
        module; ``shard``: the part of a merged projection). The loader reads only that slice, then applies
        any ``from_checkpoint`` to it."""
        ...


@runtime_checkable
class LoadsCheckpoint(Protocol):
    """A module whose parameters are laid out unlike the checkpoint's tensors (experts
    stacked from one tensor per expert): it loads the tensors under it itself."""

    def checkpoint_names(self) -> set[str]:
        """The checkpoint tensors it loads (relative to this module), in every layout it reads."""
        ...

    def checkpoint_parts(self) -> set[str]:
        """What a complete checkpoint fills, named as checkpoint tensors (relative)."""
        ...

    def load_checkpoint(self, name: str, stored: Tensor | StoredTensor) -> set[str]:
        """Copy checkpoint tensor ``name`` (relative) into the parameters; returns the parts it filled. A
        stored tensor is read here: only this rank's slice where the module is split (``part_of``)."""
        ...


@runtime_checkable
class FinishesLoading(Protocol):
    """A module that lays its weights out anew once every checkpoint tensor is in (and ``--isq``
    has packed them), for its kernels."""

    def finish_loading(self) -> None: ...


def finish_loading(model: nn.Module, release_cached: Callable[[], None] | None = None) -> None:
    """:meth:`FinishesLoading.finish_loading` of every module of ``model`` that has it, ``release_cached``
    (the device's, :meth:`xinfer.backend.DeviceMemory.release_cached`) after each. A module's new layout
    is a little larger than the tensors it frees: cached, those would be split by the next module's
    allocations and strand the rest (13 GiB over Qwen3.6-35B-A3B's layers on an 80 GB GPU)."""
    for module in list(model.modules()):
        if isinstance(module, FinishesLoading):
            module.finish_loading()
            if release_cached is not None:
                release_cached()


class CausalLM(nn.Module):
    """A decoder over a flat batch of tokens (no batch dimension).

    Subclasses build their layers from ``config`` (an HF ``PretrainedConfig``) in
    ``__init__``, keep parameter names equal to the HF checkpoint's, and name in
    ``packed_modules`` the checkpoint projections they store merged:
    ``{"q_proj": ("qkv_proj", "q")}`` loads ``...q_proj.weight`` into shard ``"q"``
    of ``...qkv_proj.weight``. A module that stores a tensor differently from the
    checkpoint converts it in ``from_checkpoint`` (see :class:`ConvertsCheckpoint`).
    """

    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {}
    cuda_graphs: ClassVar[bool] = True  # False: ops that read the step's metadata on the host (run eagerly)
    ignored_weights: ClassVar[tuple[str, ...]] = ("rotary_emb.inv_freq",)
    # True: ``load_weights`` decodes the checkpoint's quantized tensors itself (names of its own); else
    # quantized ones are decoded before it sees them (xinfer.loading.quantized_checkpoint)
    decodes_quantized_checkpoint: ClassVar[bool] = False
    # dtypes the architecture does not run in, each with why: refused when asked for, never chosen by ``auto``
    unstable_dtypes: ClassVar[dict[torch.dtype, str]] = {}

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        # Sequences longer than this many tokens compute their KV otherwise (LongRoPE's long factors); None:
        # length changes nothing. The scheduler then computes a prompt longer than it in chunks that end past it,
        # one shorter in chunks that stop at it, and the prefix cache keeps the two kinds of blocks apart
        # (xinfer.engine.scheduler).
        self.context_switch: int | None = None
        # True: a sequence that grows past context_switch is recomputed from its first token, every position
        # turned the long way (transformers' Phi-3 generate); False: the keys cached before stay as they were
        self.recompute_past_switch = False

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Hidden states [T, hidden] of the tokens ``input_ids`` at ``positions``."""
        raise NotImplementedError

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Logits [N, vocab] of the rows of ``hidden`` that are sampled, in the model dtype
        (the sampler computes in fp32)."""
        raise NotImplementedError

    def checkpoint_names(self) -> set[str]:
        """The names of the checkpoint tensors this model loads (packed shards by their
        own names)."""
        loaders = self.checkpoint_loaders()
        names = {f"{prefix}.{name}" for prefix, module in loaders.items() for name in module.checkpoint_names()}
        for name, _ in self.named_parameters(remove_duplicate=False):
            if loader_of(name, loaders) is None:
                shards = {name.replace(f".{merged}.", f".{part}.")
                          for part, (merged, _) in self.packed_modules.items() if f".{merged}." in name}  # fmt: skip
                names |= shards or {name}
        return names

    def checkpoint_loaders(self) -> dict[str, LoadsCheckpoint]:
        """The modules that load the checkpoint tensors under them themselves, by name."""
        return {name: m for name, m in self.named_modules() if isinstance(m, LoadsCheckpoint)}

    def load_weights(self, weights: Weights) -> set[str]:
        """Copy checkpoint tensors into the parameters; returns the names loaded."""
        from xinfer.loading.weights import load_weights

        return load_weights(self, self._converted(weights))

    def _converted(self, weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
        """Each tensor through the ``from_checkpoint`` of the modules it is under, innermost first."""
        converters = {name: m for name, m in self.named_modules() if isinstance(m, ConvertsCheckpoint)}
        for name, tensor in weights:
            parts = name.split(".")
            for end in range(len(parts) - 1, 0, -1):
                module = converters.get(".".join(parts[:end]))
                if module is None:
                    continue
                conversion = functools.partial(module.from_checkpoint, ".".join(parts[end:]))
                if isinstance(tensor, StoredTensor):
                    tensor = tensor.converted(conversion)  # once read (only a rank's slice, if split)
                else:
                    tensor = convert(tensor, conversion)
            yield name, tensor


def convert(tensor: Tensor, conversion: Callable[[Tensor], Tensor]) -> Tensor:
    """``conversion`` applied to a checkpoint tensor; a quantized one stays packed where the conversion
    only reorders its rows (:func:`xinfer.quant.permute_rows`), else it is converted dequantized."""
    from xinfer.quant import QuantizedTensor, permute_rows

    if not isinstance(tensor, QuantizedTensor):
        return conversion(tensor)
    permuted = permute_rows(tensor, conversion)
    return permuted if permuted is not None else conversion(tensor.dequantize())


def loader_of(name: str, loaders: dict[str, LoadsCheckpoint]) -> str | None:
    """The name of the module of ``loaders`` that tensor ``name`` is under, if any."""
    parts = name.split(".")
    return next((prefix for end in range(len(parts) - 1, 0, -1) if (prefix := ".".join(parts[:end])) in loaders), None)
