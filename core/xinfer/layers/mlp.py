from torch import Tensor, nn

from xinfer.layers.activation import gated_activation
from xinfer.layers.linear import Linear, MergedLinear
from xinfer.layers.norm import RMSNorm


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, with gate and up as one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias)
        self.act_fn = gated_activation(activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_norm(self, norm: RMSNorm, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of ``norm(h + residual)``, the norm in gate/up, and ``h + residual``."""
        gate_up, _, residual = norm.project(h, residual, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return self.down_proj(self.act_fn(gate_up)), residual
