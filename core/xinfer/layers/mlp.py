from torch import Tensor, nn

from xinfer.distributed.group import current
from xinfer.layers.activation import gated_activation
from xinfer.layers.linear import MergedLinear, RowLinear


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, with gate and up as one GEMM; under tensor parallelism each
    rank holds a part of the intermediate size (gate/up split by rows, down by columns)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False):
        super().__init__()
        part = current().split(intermediate_size, "the MLP's intermediate size")
        self.gate_up_proj = MergedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias,
                                         parts={"gate": part, "up": part})  # fmt: skip
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias, part)
        self.act_fn = gated_activation(activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))
