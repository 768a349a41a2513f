"""The attention block of a decoder layer."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from xinfer import ops
from xinfer.distributed.group import current
from xinfer.layers.attention import Attention
from xinfer.layers.linear import MergedLinear, RowLinear
from xinfer.layers.norm import RMSNorm, head_norms
from xinfer.layers.rotary import RotaryEmbedding, pairs_to_halves
from xinfer.ops import HeadNorms


class SelfAttention(nn.Module):
    """``o_proj(attention(rotary(q_norm(q)), rotary(k_norm(k)), v))`` with q, k, v from one
    merged projection; the per-head norms (``qk_norm`` builds them, if given) and the rotary
    are one fused op.

    ``interleaved_rotary``: the checkpoint rotates adjacent pairs (GPT-J style, as GLM) rather
    than halves. The rows of q and k (and the norm weights) are reordered at load so that
    the halves ``ops.rotary`` rotates are those pairs; q·k does not change when q and k are
    reordered alike, and v is untouched.

    ``output_gate``: the attention's output is multiplied by ``sigmoid(gate)`` before
    ``o_proj``, the gate coming from q's projection, which then holds per head the query
    and then the gate (Qwen3-Next, Qwen3.5).

    Under tensor parallelism each rank computes its part of the heads (KV heads replicated
    where there are fewer than ranks), and ``o_proj`` sums the ranks' outputs; ``num_heads``
    and ``num_kv_heads`` are then this rank's.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: Callable[[int], RMSNorm] | None = None,
        scale: float | None = None,
        window: int | None = None,
        softcap: float | None = None,
        interleaved_rotary: bool = False,
        output_gate: bool = False,
    ):
        super().__init__()
        tp = current()
        heads, kv_heads = tp.split(num_heads, "attention heads"), tp.heads(num_kv_heads, "KV heads")
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.output_gate = output_gate
        q_rows = 2 * q_size if output_gate else q_size
        parts = {"q": heads, "k": kv_heads, "v": kv_heads}
        self.qkv_proj = MergedLinear(hidden_size, {"q": q_rows, "k": kv_size, "v": kv_size}, qkv_bias, parts)
        self.o_proj = RowLinear(q_size, hidden_size, o_bias, heads)
        self.num_heads, self.num_kv_heads = heads.size(num_heads), kv_heads.size(num_kv_heads)
        self.head_dim = head_dim
        self.q_norm = qk_norm(head_dim) if qk_norm else None
        self.k_norm = qk_norm(head_dim) if qk_norm else None
        self.rotary_emb = rotary
        self.interleaved_rotary = interleaved_rotary
        scale = head_dim**-0.5 if scale is None else scale
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, scale=scale, window=window, softcap=softcap)

    def forward(self, positions: Tensor, x: Tensor) -> Tensor:
        return self.attend(positions, self.qkv_proj(x))

    def forward_norm(
        self, positions: Tensor, norm: RMSNorm, h: Tensor, residual: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """:meth:`forward` of ``norm(h + residual)``, the norm in the qkv projection, and ``h + residual``."""
        qkv, _, residual = norm.project(h, residual, self.qkv_proj.weight, self.qkv_proj.bias)
        return self.attend(positions, qkv), residual

    def attend(self, positions: Tensor, qkv: Tensor) -> Tensor:
        q, k, v, gate, norms = self.heads(qkv)
        out = self.attn(q, k, v, self.rotary_emb.rotation(positions, norms))  # norms, rotary, attention: one op
        if gate is not None:  # per head: the gate's rows are strided by q's
            out = ops.sigmoid_gate(out.view(-1, self.head_dim), gate.flatten(0, 1)).view(out.shape)
        return self.o_proj(out)

    def heads(self, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None, HeadNorms | None]:
        """From the merged projection's output: queries [T, H, D] (with the output gate, a view
        whose heads are strided by the gate's) and keys [T, Hkv, D] as projected; values [T, Hkv*D]; the output gate [T, H, D] (None without one); the
        per-head norms of q and k, which the attention op applies before the rotary (None
        without them)."""
        q, k, v = self.qkv_proj.split(qkv)
        gate = None
        if self.output_gate:
            q, gate = q.unflatten(-1, (self.num_heads, 2 * self.head_dim)).chunk(2, dim=-1)  # views: the rotary reads
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        norms = head_norms(self.q_norm, self.k_norm) if self.q_norm is not None and self.k_norm is not None else None
        return q, k, v, gate, norms

    def from_checkpoint(self, name: str, tensor: Tensor) -> Tensor:
        if not self.interleaved_rotary:
            return tensor
        module = name.split(".")[0]
        if module == "qkv_proj":
            raise NotImplementedError("interleaved rotary needs the checkpoint's q_proj and k_proj apart")
        if module in ("q_proj", "k_proj", "q_norm", "k_norm"):  # every head of the checkpoint's tensor
            return pairs_to_halves(tensor, tensor.shape[0] // self.head_dim, self.rotary_emb.rotary_dim)
        return tensor
