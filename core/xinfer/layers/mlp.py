from torch import Tensor, nn

from xinfer.distributed.group import current
from xinfer.layers.activation import gated_activation
from xinfer.layers.linear import MergedLinear, RowLinear
from xinfer.layers.norm import RMSNorm
from xinfer.torch_ops import clamp_gate_up


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, with gate and up as one GEMM; with ``limit``, the gate
    clamped to at most ``limit`` and up to ``[-limit, limit]`` first (a clamped SwiGLU). Under tensor
    parallelism each rank holds a part of the intermediate size (gate/up split by rows, down by columns)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False, limit: float | None = None
    ):
        super().__init__()
        part = current().split(intermediate_size, "the MLP's intermediate size")
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias,
                                         parts={"gate": part, "up": part})  # fmt: skip
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias, part)
        self.act_fn = gated_activation(activation)
        self.limit = limit

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.gate_up_proj(x))

    def forward_norm(self, norm: RMSNorm, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of ``norm(h + residual)``, the norm in gate/up, and ``h + residual``."""
        gate_up, _, residual = norm.project(h, residual, self.gate_up_proj.weight, self.gate_up_proj.bias)
        return self.down(gate_up), residual

    def down(self, gate_up: Tensor) -> Tensor:
        """The output from gate/up's [T, 2I]."""
        if self.limit is not None:
            gate_up = clamp_gate_up(gate_up, self.limit)
        return self.down_proj(self.act_fn(gate_up))
