from __future__ import annotations

from torch import Tensor, nn

from xinfer import ops
from xinfer.kv import LayerKVCache
from xinfer.forward_context import attention_metadata


class Attention(nn.Module):
    """Paged attention of one layer: stores this step's K/V in the layer's cache,
    then attends over each sequence's cached context.

    ``q`` [T, H*D], ``k``/``v`` [T, Hkv*D] in; [T, H*D] out. The engine binds
    ``kv_cache`` (allocated by the cache's format) before the first forward.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.kv_cache: LayerKVCache | None = None

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        meta = attention_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        assert self.kv_cache is not None, "the engine binds the KV cache before the first forward"
        out = ops.attention(q, k, v, self.kv_cache, meta, self.scale, self.window, self.softcap)
        return out.flatten(1)
