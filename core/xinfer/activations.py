"""Activation functions by the HF config's name, in plain torch (transformers' ``ACT2FN``, less the two with
weights of their own, ``prelu`` and ``xielu``): the one table the layers and the ops' references share."""

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor


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
"""The encoders' plain MLPs, ``act(gate) * up`` where no op fuses ``act``, and experts' ``act`` in the
reference ``fused_moe``."""


def act_and_mul(act: Callable[[Tensor], Tensor], gate_up: Tensor) -> Tensor:
    """``act(gate) * up`` of ``gate_up`` [..., 2I] (gate, then up)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


# transformers' other names of the same functions (gelu_new and gelu_fast: the tanh approximation)
ALIASES = {
    "swish": "silu",
    "gelu_new": "gelu_pytorch_tanh",
    "gelu_fast": "gelu_pytorch_tanh",
    "gelu_accurate": "gelu_pytorch_tanh",
    "gelu_python_tanh": "gelu_pytorch_tanh",
    "gelu_python": "gelu",
}
