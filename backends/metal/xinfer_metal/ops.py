"""The ops on Apple silicon (see :class:`xinfer.ops.Ops` for the contract): the plain-torch
reference (:class:`xinfer.torch_ops.TorchOps`) on the ``mps`` device, which has fast paths for
the dense ops (matmuls, norms, activations, sampling), and Metal kernels for what it has
none for: storing into the paged KV cache and attention over its block table, reading
fp8/turbo8/turbo4 codes in place.

What it declares: the formats the kernels store and read (turbo3 and the Lloyd–Max
formats are refused at start-up in one line), no recent window, and no step capture
(``capture_steps`` is absent, so the engine runs every step eagerly: Metal has no CUDA
graphs).
"""

from __future__ import annotations

from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata
from xinfer.torch_ops import TorchOps
from xinfer_metal.kernels import attention, kv_write


class MetalOps(TorchOps):
    name = "metal"
    # the formats whose both sides kernels/kv_codes.metal stores and reads
    kv_formats = frozenset({"auto", "fp8", "turbo8", "turbo4"})
    recent_window = False

    def write_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, slot_mapping: Tensor) -> None:
        """Store ``k``, ``v`` [T, Hkv, D] into ``cache`` in its format (the storing half of
        :meth:`attention`, which the reference composes with :meth:`attend`)."""
        if not kv_write.covers(cache):  # a head dim beyond the kernels
            return super().write_kv(k, v, cache, slot_mapping)
        kv_write.write_kv(k, v, cache, slot_mapping)

    def attend(
        self,
        q: Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """The attending half of :meth:`attention`, over the cache as it is."""
        if not attention.covers(q, cache):
            return super().attend(q, cache, meta, scale, window, softcap)
        return attention.paged_attention(q, cache, meta, scale, window, softcap)
