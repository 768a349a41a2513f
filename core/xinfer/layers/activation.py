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


GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul, "gelu": GeluAndMul}
"""``act(gate) * up`` by the HF config's name of ``act``."""

# transformers' other names of the same functions (gelu_new and gelu_fast: the tanh approximation)
ALIASES = {"swish": "silu", "gelu_new": "gelu_pytorch_tanh", "gelu_fast": "gelu_pytorch_tanh"}


def activation_name(name: str) -> str:
    """The name ``act`` goes by in :data:`GATED_ACTIVATIONS` and the ops (``name`` is the config's
    ``hidden_act``); one error naming it where xinfer has no such activation."""
    name = ALIASES.get(name, name)
    if name not in GATED_ACTIVATIONS:
        raise NotImplementedError(
            f"hidden_act {name!r} is not supported; supported: {', '.join([*GATED_ACTIVATIONS, *ALIASES])}"
        )
    return name


def gated_activation(name: str) -> nn.Module:
    return GATED_ACTIVATIONS[activation_name(name)]()
