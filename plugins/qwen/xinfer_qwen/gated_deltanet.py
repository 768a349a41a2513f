"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5 / Qwen3.6 (linear attention with a
delta-rule state; Yang et al., "Gated Delta Networks", 2024).

Per token: q, k, v through a causal depthwise convolution and the config's ``hidden_act`` (SiLU in the
checkpoints); per value head a decay
``g = -exp(A_log) * softplus(a + dt_bias)`` and a write strength ``beta = sigmoid(b)``; the
gated delta rule updates the head's state S [Dk, Dv] and reads ``o = S^T q``; the output is
``out_proj(rms_norm(o) * silu(z))``. A sequence's conv window and S live in its state slot
(:class:`~xinfer.cache.specs.RecurrentStateSpec`), so decode costs the same at any length.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from xinfer import ops
from xinfer.cache.specs import RecurrentStateSpec
from xinfer.distributed import current
from xinfer.distributed.group import WHOLE, Part, Slice
from xinfer.forward_context import attention_metadata, state_slots
from xinfer.layers import MergedLinear, RMSNorm, RowLinear
from xinfer.layers.activation import OpActivation, activation_name


class CausalConv1d(nn.Module):
    """A depthwise causal convolution over time, ``weight`` [C, K] (HF's Conv1d holds [C, 1, K])."""

    def __init__(self, channels: int, kernel_size: int, part: Part = WHOLE):
        super().__init__()
        self.part = part  # this rank's channels, under tensor parallelism
        self.weight = nn.Parameter(torch.empty(part.size(channels), kernel_size))

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        return tensor.reshape(tensor.shape[0], -1)

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        return self.part.slice(shape[0])


class GatedDeltaNet(nn.Module):
    """``x`` [T, hidden] -> [T, hidden]; HF's parameter names (Qwen3.5's). Its input
    projections are one GEMM, ``in_proj``: ``q | k | v`` (the conv's channels), ``z``, ``b``,
    ``a``, each over all heads in order.

    Under tensor parallelism each rank runs its part of the key heads and of the value heads (those
    that read them), and ``out_proj`` sums the ranks' outputs; the head counts are then this rank's."""

    def __init__(self, config: Any):
        super().__init__()
        if config.linear_num_value_heads % config.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads {config.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads {config.linear_num_key_heads}: a value head reads one key head")  # fmt: skip
        tp = current()
        key_heads = tp.split(config.linear_num_key_heads, "DeltaNet key heads")
        self.value_heads = tp.split(config.linear_num_value_heads, "DeltaNet value heads")
        self.num_k_heads = key_heads.size(config.linear_num_key_heads)
        self.num_v_heads = self.value_heads.size(config.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.activation = activation_name(config.hidden_act)  # the conv's, as transformers applies it
        self.op_activations = (OpActivation("causal_conv1d", self.activation),)
        key_dim, value_dim = (
            config.linear_num_key_heads * self.head_k_dim,
            config.linear_num_value_heads * self.head_v_dim,
        )
        conv = tp.split(2 * key_dim + value_dim, "DeltaNet channels", blocks=(key_dim, key_dim, value_dim))  # q, k, v
        heads = config.linear_num_value_heads
        shards = {"qkv": 2 * key_dim + value_dim, "z": value_dim, "b": heads, "a": heads}
        parts = {"qkv": conv, "z": self.value_heads, "b": self.value_heads, "a": self.value_heads}
        self.in_proj = MergedLinear(config.hidden_size, shards, parts=parts)
        self.conv1d = CausalConv1d(2 * key_dim + value_dim, config.linear_conv_kernel_dim, conv)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = RMSNorm(self.head_v_dim, config.rms_norm_eps)  # plain weight, unlike the model's other norms
        self.out_proj = RowLinear(value_dim, config.hidden_size, part=self.value_heads)
        self.cache: dict[str, Tensor] | None = None
        self.page_group = 0

    def rank_slice(self, name: str, shard: str | None, shape: torch.Size) -> Slice:
        return self.value_heads.slice(shape[0])  # A_log, dt_bias

    def cache_spec(self) -> RecurrentStateSpec:
        conv_channels, kernel_size = self.conv1d.weight.shape
        state = (self.num_v_heads, self.head_k_dim, self.head_v_dim)
        return RecurrentStateSpec(shapes={"conv": (conv_channels, kernel_size - 1), "ssm": state}, dtype=torch.float32)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.mix(self.in_proj(x))

    def forward_norm(
        self, positions: Tensor, norm: RMSNorm, h: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of ``norm(h + residual)``, the norm in ``in_proj``, and ``h + residual``."""
        projected, _, residual = norm.project(h, residual, self.in_proj.weight, self.in_proj.bias)
        return self.mix(projected), residual

    def mix(self, projected: Tensor) -> Tensor:
        """The output from ``in_proj``'s [T, qkv | z | b | a]."""
        assert self.cache is not None, "the engine binds the recurrent state before the first forward"
        meta, slots = attention_metadata(), state_slots()
        qkv, z, b, a = self.in_proj.split(projected)
        qkv = ops.call("causal_conv1d", qkv, self.conv1d.weight, None, self.cache["conv"], meta, slots, self.activation)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        normed = ops.call(
            "gated_delta_rule_norm",
            q.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            k.unflatten(-1, (self.num_k_heads, self.head_k_dim)),
            v.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
            a,
            b,
            self.A_log,
            self.dt_bias,
            self.cache["ssm"],
            meta,
            slots,
            z.unflatten(-1, (self.num_v_heads, self.head_v_dim)),
            self.norm.weight,
            self.norm.eps,
        )
        return self.out_proj(normed)
