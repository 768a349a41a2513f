"""What-if for ``kv_quality.py --exact-window W --exact-sink S``: every query reads the
keys and values of its own last ``W`` positions and of its context's first ``S``
positions unquantized, everything else from the quantized cache (a recent window and
attention sinks in the model dtype, as a cache layout could keep them).

Simulated on the CPU backend: exact K/V are kept beside each quantized cache, and the
scores and outputs of the positions a query should see exactly are taken from them.
No backend implements such a layout; this measures what one would buy.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata
from xinfer_cpu.ops import gather_context


class ExactWindow:
    """Ops (CPU) that attend as described above; ``inner`` does everything else."""

    def __init__(self, inner, window: int, sink: int):
        self.inner, self.window, self.sink = inner, window, sink
        self.exact: dict[int, tuple[weakref.ref, Tensor, Tensor]] = {}

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _exact(self, cache: LayerKVCache) -> tuple[Tensor, Tensor]:
        entry = self.exact.get(id(cache))
        if entry is None or entry[0]() is not cache["k"]:
            self.exact = {key: e for key, e in self.exact.items() if e[0]() is not None}
            shape = (*cache["k"].shape[:3], cache.head_dim)
            entry = (weakref.ref(cache["k"]), torch.zeros(shape), torch.zeros(shape))
            self.exact[id(cache)] = entry
        return entry[1], entry[2]

    def write_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, slot_mapping: Tensor) -> None:
        self.inner.write_kv(k, v, cache, slot_mapping)
        if cache.format.name == "auto":
            return
        valid = slot_mapping >= 0
        for store, x in zip(self._exact(cache), (k, v)):
            store.view(-1, *store.shape[2:])[slot_mapping[valid]] = x[valid].float()

    def attention(
        self, q: Tensor, cache: LayerKVCache, meta: AttentionMetadata, scale: float, window=None, softcap=None
    ) -> Tensor:
        fmt = cache.format
        if fmt.name == "auto":
            return self.inner.attention(q, cache, meta, scale, window, softcap)
        exact_k, exact_v = self._exact(cache)
        query = fmt.prepare_query(q, cache.equalizer)
        out = torch.empty(q.shape, dtype=torch.float32)
        cu, seq_lens = meta.cu_seqlens_q.tolist(), meta.seq_lens.tolist()
        for b, context_len in enumerate(seq_lens):
            start, end = cu[b], cu[b + 1]
            if end == start:
                continue
            table = meta.block_tables[b]
            k, v = fmt.decode({n: gather_context(t, table, context_len) for n, t in cache.tensors.items()})
            ke, ve = fmt.stored_basis(
                gather_context(exact_k, table, context_len), gather_context(exact_v, table, context_len),
                cache.equalizer, cache.key_offset,
            )  # fmt: skip
            out[start:end] = self._attend(query[start:end], k, v, ke, ve, scale, window, softcap)
        return fmt.finish_output(out).to(q.dtype)

    def _attend(self, q, k, v, ke, ve, scale, window, softcap) -> Tensor:
        num_q, heads, dim = q.shape
        context_len, kv_heads, _ = k.shape
        group = heads // kv_heads
        q = q.float().view(num_q, kv_heads, group, dim).permute(1, 2, 0, 3).flatten(1, 2)
        q_pos = torch.arange(context_len - num_q, context_len).repeat(group)[:, None]
        k_pos = torch.arange(context_len)[None, :]
        exact = (q_pos - k_pos < self.window) | (k_pos < self.sink)
        scores = torch.where(exact, q @ ke.permute(1, 2, 0), q @ k.permute(1, 2, 0)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out = (probs * exact) @ ve.transpose(0, 1) + (probs * ~exact) @ v.transpose(0, 1)
        return out.view(kv_heads, group, num_q, dim).permute(2, 0, 1, 3).reshape(num_q, heads, dim)
