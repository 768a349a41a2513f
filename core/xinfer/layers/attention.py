from __future__ import annotations

from torch import Tensor, nn

from xinfer import ops
from xinfer.cache.specs import AttentionSpec
from xinfer.forward_context import attention_metadata
from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata


def check_head_groups(num_heads: int, num_kv_heads: int, config: str = "") -> None:
    """One error, naming the fields of ``config`` (a prefix such as ``"vision_config."``), where the query heads do
    not split into whole groups over the key and value heads (transformers repeats each key and value head
    ``num_heads // num_kv_heads`` times: a shape error)."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{config}num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}: "
            "each key and value head serves a whole group of query heads"
        )


class Attention(nn.Module):
    """Paged attention of one layer: stores this step's K/V in the layer's cache,
    then attends over each sequence's cached context.

    ``q`` [T, H*D], ``k``/``v`` [T, Hkv*D] in; [T, H*D] out. It caches
    :class:`~xinfer.cache.specs.AttentionSpec`; the engine binds ``cache`` (allocated in
    its KV format) and ``page_group`` before the first forward.
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
        check_head_groups(num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = window
        self.softcap = softcap
        self.cache: LayerKVCache | None = None
        self.page_group = 0

    def cache_spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_kv_heads, self.head_dim, self.window)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, rotation: ops.Rotation | None = None) -> Tensor:
        """With ``rotation``, q and k are rotated (and normed) by it first, in the same op."""
        meta = self.step_metadata()
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        assert self.cache is not None, "the engine binds the KV cache before the first forward"
        if rotation is None:
            out = ops.attention(q, k, v, self.cache, meta, self.scale, self.window, self.softcap)
        else:
            out = ops.rotary_attention(q, k, v, rotation, self.cache, meta, self.scale, self.window, self.softcap)
        return out.flatten(1)

    def step_metadata(self) -> AttentionMetadata:
        """The step's attention metadata as this layer reads it."""
        return attention_metadata(self.page_group)
