"""Triton ops for CUDA GPUs (see :class:`xinfer.ops.Ops` for the contract).

The kernels take any tensors Triton can address, so under ``TRITON_INTERPRET=1`` they
also run on CPU tensors (that is how CI tests them).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from xinfer.kv import LayerKVCache, hadamard
from xinfer.kv.equalizer import divide_keys, scale_queries
from xinfer.ops import AttentionMetadata, StepForward, StepLimits
from xinfer_cuda.graphs import StepGraphs
from xinfer_cuda.kernels import activation, attention, kv_quant_write, kv_write, norm, rotary
from xinfer_cuda.kernels.kv_codes import side


def is_available() -> bool:
    return torch.cuda.is_available()


class CudaOps:
    device_type = "cuda"

    def rms_norm(
        self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        return norm.rms_norm(x, weight, eps, residual)

    def rotary(
        self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor
    ) -> tuple[Tensor, Tensor]:
        return rotary.rotary(q, k, positions, cos_sin)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return activation.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: Tensor) -> Tensor:
        return activation.gelu_tanh_and_mul(x)

    def write_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, slot_mapping: Tensor) -> None:
        fmt = cache.format
        if fmt.name == "auto":
            kv_write.write_kv(k, v, cache["k"], cache["v"], slot_mapping)
            return
        # This step's keys and values only, before they are quantized.
        if fmt.rotate_keys:
            k = divide_keys(k, cache.equalizer) if cache.equalizer is not None else k
            k = k @ basis(k.shape[-1], k.dtype, k.device)
        if fmt.rotate_values:
            v = v @ basis(v.shape[-1], v.dtype, v.device)
        kv_quant_write.quant_write(k, side(cache, "k", fmt.key), slot_mapping)
        kv_quant_write.quant_write(v, side(cache, "v", fmt.value), slot_mapping)

    def attention(
        self,
        q: Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        fmt = cache.format
        if fmt.rotate_keys:
            q = scale_queries(q, cache.equalizer) if cache.equalizer is not None else q
            q = q @ basis(q.shape[-1], q.dtype, q.device)
        out = attention.paged_attention_cache(q, cache, meta, scale, window, softcap)
        return out @ basis(out.shape[-1], out.dtype, out.device).T if fmt.rotate_values else out

    def capture_steps(self, forward: StepForward, limits: StepLimits, device: torch.device) -> StepGraphs:
        return StepGraphs(forward, limits, device)


@functools.cache
def basis(head_dim: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Rᵀ of :func:`hadamard.rotation` in the model dtype: ``x @ basis`` rotates, and
    ``y @ basis.T`` rotates back, one GEMM each. All entries share one magnitude, so
    rounding to bf16 scales the matrix uniformly and it stays orthogonal up to that
    factor (1 - 1e-4 at head_dim 128)."""
    return hadamard.rotation(head_dim, device).T.contiguous().to(dtype)
