"""The CPU backend computes with the plain-torch reference, and packed weights through torch's
weight-only int4/int8 matmuls (:mod:`xinfer_cpu.quant`).

On the CPU every op is its own call through torch's dispatcher and Python (a few µs each, more
than a decode step's norm or rotary computes), so the ops overridden here compute what the
reference does in fewer torch calls: one fused norm, the rotary's table looked up once a step,
the KV write without boolean indexing, the decode steps' attention batched by context length
(:mod:`xinfer_cpu.attention`), and top-p sampling without sorting the vocabulary
(:mod:`xinfer_cpu.sampling`)."""

from __future__ import annotations

import torch
from torch import Tensor

from xinfer.forward_context import once_per_step
from xinfer.kv import LayerKVCache
from xinfer.ops import AttentionMetadata, HeadNorms
from xinfer.sampling import SamplingBatch
from xinfer.torch_ops import TorchOps
from xinfer_cpu.attention import decode_attention, is_decode
from xinfer_cpu.quant import WEIGHT_KERNELS
from xinfer_cpu.sampling import sample


class CpuOps(TorchOps):
    name = "cpu"
    weight_kernels = WEIGHT_KERNELS

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = _as(torch.rms_norm(_as(x, torch.float32), x.shape[-1:], _as(weight, torch.float32), eps), x.dtype)
        return out if residual is None else (out, residual)

    def rotary(self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, norms: HeadNorms | None = None):
        if norms is not None:
            q, k = self.rms_norm(q, norms.q_weight, norms.eps), self.rms_norm(k, norms.k_weight, norms.eps)
        cos, sin = once_per_step("cpu.rotary", (positions, cos_sin), lambda: _rotation_table(positions, cos_sin))
        heads = _heads_together(q, k)
        if heads is None:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        q, k = _rotate(heads, cos, sin).split_with_sizes((q.shape[1], k.shape[1]), dim=1)
        return q, k

    def write_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, slot_mapping: Tensor) -> None:
        if not once_per_step("cpu.slots_valid", (slot_mapping,), lambda: bool((slot_mapping >= 0).all())):
            return super().write_kv(k, v, cache, slot_mapping)  # padding rows to skip
        stored = cache.format.quantize(k, v, cache.dtype, cache.equalizer, cache.key_offset)
        for name, values in stored.items():
            tensor = cache[name]
            tensor.view(-1, *tensor.shape[2:]).index_copy_(0, slot_mapping, values)

    def attend(
        self,
        q: Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        if softcap is None and is_decode(q, meta):
            return decode_attention(q, cache, meta, scale, window)
        return super().attend(q, cache, meta, scale, window, softcap)

    def sample(self, logits: Tensor, params: SamplingBatch) -> Tensor:
        return sample(logits, params)


def _rotation_table(positions: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    """``(cos || cos, -sin || sin)`` [T, 1, R] of ``positions``: rotating halves ``(x1, x2)`` is then
    ``x * cos + (x2, x1) * sin``."""
    cos, sin = cos_sin[positions].float().unsqueeze(1).chunk(2, dim=-1)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _heads_together(q: Tensor, k: Tensor) -> Tensor | None:
    """q's and k's heads as one tensor [T, Hq + Hk, D] where k's heads follow q's in one buffer (the
    merged projection's output, before any head norm), so that they rotate in one set of ops; else None."""
    t, heads, dim = q.shape
    follows = q.data_ptr() + heads * dim * q.element_size()
    if k.data_ptr() != follows or k.shape[::2] != (t, dim) or q.stride()[1:] != (dim, 1) or k.stride()[1:] != (dim, 1):
        return None
    if t > 1 and q.stride(0) != k.stride(0):  # (a dimension of one has any stride)
        return None
    if q.dtype != k.dtype or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr():
        return None
    return q.as_strided((t, heads + k.shape[1], dim), q.stride())


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    rot_dim = cos.shape[-1]
    if rot_dim < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rot_dim], cos, sin), x[..., rot_dim:]), dim=-1)
    x32 = _as(x, torch.float32)
    return _as(x32 * cos + x32.roll(rot_dim // 2, dims=-1) * sin, x.dtype)  # (x2, x1) by the roll


def _as(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``, without a call into torch when it is a no-op (most of them, in an fp32 model)."""
    return x if x.dtype == dtype else x.to(dtype)
