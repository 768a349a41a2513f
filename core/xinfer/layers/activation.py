import math
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


class ActAndMul(nn.Module):
    """``act(gate) * up`` in torch on every backend, for the activations no model in wide use has: no backend
    fuses them."""

    def __init__(self, act: Callable[[Tensor], Tensor]):
        super().__init__()
        self.act = act

    def forward(self, x: Tensor) -> Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


def quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def clipped_gelu(x: Tensor) -> Tensor:
    return F.gelu(x).clamp(-10, 10)


def squared_relu(x: Tensor) -> Tensor:
    return F.relu(x).square()


def laplace(x: Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> Tensor:
    """The Laplace CDF-like gate of MEGA, as transformers defines it."""
    return 0.5 * (1.0 + torch.erf((x - mu) / (sigma * math.sqrt(2.0))))


def sqrt_softplus(x: Tensor) -> Tensor:
    return F.softplus(x).sqrt()


def identity(x: Tensor) -> Tensor:
    return x


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "relu": F.relu,
    "gelu_10": clipped_gelu,
    "relu2": squared_relu,
    "relu6": F.relu6,
    "leaky_relu": F.leaky_relu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "laplace": laplace,
    "sqrtsoftplus": sqrt_softplus,
    "linear": identity,
}
"""Activations by the HF config's name (transformers' ``ACT2FN``, less the two with weights of their own,
``prelu`` and ``xielu``): the encoders' plain MLPs, and ``act(gate) * up`` where no op fuses ``act``."""

FUSED_GATED: dict[str, type[nn.Module]] = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu": GeluAndMul}
"""``act(gate) * up`` as one op of the backend's, by the HF config's name of ``act``."""

EXPERT_ACTIVATIONS = tuple(ops.GATED_OPS)
"""The ``act`` of ``act(gate) * up`` that :meth:`xinfer.ops.Ops.fused_moe` takes."""

# transformers' other names of the same functions (gelu_new and gelu_fast: the tanh approximation)
ALIASES = {
    "swish": "silu",
    "gelu_new": "gelu_pytorch_tanh",
    "gelu_fast": "gelu_pytorch_tanh",
    "gelu_accurate": "gelu_pytorch_tanh",
    "gelu_python_tanh": "gelu_pytorch_tanh",
    "gelu_python": "gelu",
}


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
    """``act(gate) * up`` for the ``act`` a config's ``field`` names: the backend's op where it has one."""
    name = _known(name, ACTIVATIONS, field)
    return FUSED_GATED[name]() if name in FUSED_GATED else ActAndMul(ACTIVATIONS[name])


def activation(name: str, field: str = "hidden_act") -> Callable[[Tensor], Tensor]:
    """The plain activation a config's ``field`` names; one error naming both where xinfer has none."""
    return ACTIVATIONS[_known(name, ACTIVATIONS, field)]
