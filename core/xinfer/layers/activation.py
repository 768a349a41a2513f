from collections.abc import Callable, Collection
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xinfer import ops


class SiluAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu_tanh_and_mul(x)


class GeluAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu_and_mul(x)


class ReluAndMul(nn.Module):
    """In torch on every backend: no model in wide use has it, so no backend fuses it."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.relu(gate) * up


GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu": GeluAndMul, "relu": ReluAndMul}
"""``act(gate) * up`` by the HF config's name of ``act``."""

EXPERT_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
"""The ``act`` of ``act(gate) * up`` that :meth:`xinfer.ops.Ops.fused_moe` takes."""

# transformers' other names of the same functions (gelu_new and gelu_fast: the tanh approximation)
ALIASES = {"swish": "silu", "gelu_new": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh"}


def _known(name: str, supported: Collection[str], field: str) -> str:
    name = ALIASES.get(name, name)
    if name not in supported:
        raise NotImplementedError(f"{field} {name!r} is not supported; supported: {', '.join([*supported, *ALIASES])}")
    return name


def activation_name(name: str, field: str = "hidden_act") -> str:
    """The name experts' ``act`` goes by in :data:`EXPERT_ACTIVATIONS` (``name`` is the config's ``field``);
    one error naming both where the experts have no such activation."""
    return _known(name, EXPERT_ACTIVATIONS, field)


def gated_activation(name: str, field: str = "hidden_act") -> nn.Module:
    return GATED_ACTIVATIONS[_known(name, GATED_ACTIVATIONS, field)]()


def quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "relu": F.relu,
}
"""Plain (ungated) activations by the HF config's name, for the encoders' MLPs."""


def activation(name: str, field: str = "hidden_act") -> Callable[[Tensor], Tensor]:
    """The plain activation a config's ``field`` names; one error naming both where xinfer has none."""
    return ACTIVATIONS[_known(name, ACTIVATIONS, field)]
