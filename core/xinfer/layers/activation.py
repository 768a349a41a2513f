from torch import Tensor, nn

from xinfer import ops


class SiluAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu_tanh_and_mul(x)


GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}
"""``act(gate) * up`` by the HF config's name of ``act``."""


def gated_activation(name: str) -> nn.Module:
    if name not in GATED_ACTIVATIONS:
        raise NotImplementedError(f"activation {name!r} is not supported; supported: {', '.join(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[name]()
