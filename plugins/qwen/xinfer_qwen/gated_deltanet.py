"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5 / Qwen3.6 (linear attention with a
delta-rule state; Yang et al., "Gated Delta Networks", 2024).

Per token: q, k, v through a causal depthwise convolution (SiLU); per value head a decay
``g = -exp(A_log) * softplus(a + dt_bias)`` and a write strength ``beta = sigmoid(b)``; the
gated delta rule updates the head's state S [Dk, Dv] and reads ``o = S^T q``; the output is
``out_proj(rms_norm(o) * silu(z))``. A sequence's conv window and S live in its state slot
(:class:`~xinfer.cache.specs.RecurrentStateSpec`), so decode costs the same at any length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xinfer import ops
from xinfer.cache.specs import RecurrentStateSpec
from xinfer.forward_context import attention_metadata, state_slots
from xinfer.layers import Linear, MergedLinear, RMSNorm


class CausalConv1d(nn.Module):
    """A depthwise causal convolution over time, ``weight`` [C, K] (HF's Conv1d holds [C, 1, K])."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        return tensor.reshape(self.weight.shape)


class GatedDeltaNet(nn.Module):
    """``x`` [T, hidden] -> [T, hidden]; HF's parameter names.

    The input projections are one GEMM whose output is ``q | k | v | z | b | a``, each
    all heads in order: Qwen3.5's four projections are its shards; Qwen3-Next's two fused
    ones (``fused_projections``), whose rows are grouped per key head, are reordered to it
    at load.
    """

    def __init__(self, config, fused_projections: bool = False):
        super().__init__()
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_dim, value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.sizes = [key_dim, key_dim, value_dim, value_dim, self.num_v_heads, self.num_v_heads]  # q k v z b a
        if config.hidden_act != "silu":
            raise NotImplementedError(f"Gated DeltaNet with hidden_act {config.hidden_act!r}: only silu is supported")
        shards = (
            {"qkvz": 2 * key_dim + 2 * value_dim, "ba": 2 * self.num_v_heads}
            if fused_projections
            else {"qkv": 2 * key_dim + value_dim, "z": value_dim, "b": self.num_v_heads, "a": self.num_v_heads}
        )
        self.in_proj = MergedLinear(config.hidden_size, shards)
        self.conv1d = CausalConv1d(2 * key_dim + value_dim, config.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = RMSNorm(self.head_v_dim, config.rms_norm_eps)  # plain weight, unlike the model's other norms
        self.out_proj = Linear(value_dim, config.hidden_size)
        self.cache: dict[str, Tensor] | None = None
        self.page_group = 0

    def cache_spec(self) -> RecurrentStateSpec:
        conv_channels, kernel_size = self.conv1d.weight.shape
        state = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        return RecurrentStateSpec(shapes={"conv": (conv_channels, kernel_size - 1), "ssm": state}, dtype=torch.float32)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        assert self.cache is not None, "the engine binds the recurrent state before the first forward"
        meta, slots = attention_metadata(), state_slots()
        qkv_z_b_a = self.in_proj(x)
        qkv, z, b, a = qkv_z_b_a.split([sum(self.sizes[:3]), *self.sizes[3:]], dim=-1)
        qkv = ops.call("causal_conv1d", qkv, self.conv1d.weight, None, self.cache["conv"], meta, slots)
        q, k, v = qkv.split(self.sizes[:3], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        o = ops.call(
            "gated_delta_rule",
            q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
            g,
            b.sigmoid(),
            self.cache["ssm"],
            meta,
            slots,
        )
        o = self.norm(o) * F.silu(z.unflatten(-1, (self.num_v_heads, self.head_v_dim)))
        return self.out_proj(o.flatten(1))

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        """Qwen3-Next's fused projections to the layout of :attr:`in_proj`: its rows come per key
        head as ``q | k | v | z`` (and ``b | a``), that head's share of the value heads in each."""
        if name == "in_proj_qkvz.weight":
            per_head = [self.head_k_dim, self.head_k_dim, *[self.head_v_dim * self.group] * 2]
            return torch.cat([part.flatten(0, 1) for part in self._per_key_head(tensor, per_head)])
        if name == "in_proj_ba.weight":
            return torch.cat([part.flatten(0, 1) for part in self._per_key_head(tensor, [self.group] * 2)])
        return tensor

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    def _per_key_head(self, tensor: Tensor, sizes: list[int]) -> tuple[Tensor, ...]:
        return tensor.unflatten(0, (self.num_k_heads, sum(sizes))).split(sizes, dim=1)
