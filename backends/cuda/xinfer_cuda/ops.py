"""Triton ops for CUDA GPUs (see :class:`xinfer.ops.Ops` for the contract); every op
not overridden here is the plain-torch reference's (:class:`xinfer.torch_ops.TorchOps`).

The kernels take any tensors Triton can address, so under ``TRITON_INTERPRET=1`` they
also run on CPU tensors (that is how CI tests them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from xinfer.kv import LayerKVCache
from xinfer.ops import GATED_OPS, AttentionMetadata, HeadNorms, KernelHelpers, Rotation, StepForward, StepLimits
from xinfer.sampling import SamplingBatch
from xinfer.torch_ops import TorchOps
from xinfer_cuda.graphs import StepGraphs
from xinfer_cuda.kernels import (
    activation,
    attention,
    encoder_attention,
    kv_quant_write,
    kv_write,
    launch,
    moe,
    moe_routing,
    norm,
    rotary,
    sampling,
    shared,
    token_bitmask,
)
from xinfer_cuda.kernels.gemv import MAX_ROWS
from xinfer_cuda.linear import SmallBatchLinear
from xinfer_cuda.moe_tiles import SmallBatchMoE
from xinfer_cuda.quant_weights import WEIGHT_KERNELS
from xinfer_cuda.tile_cache import TILE_CACHE

if TYPE_CHECKING:
    from xinfer.layers.moe import Routing

log = logging.getLogger("xinfer")


class CudaOps(TorchOps):
    name = "cuda"
    # the formats whose codecs kernels/kv_codes.py has Triton code for
    kv_formats = frozenset({"auto", "fp8", "turbo8", "turbo4", "turbo3", "turbo4-lm", "turbo3-lm"})
    recent_window = True
    weight_kernels = WEIGHT_KERNELS  # the GGUF block formats, read packed
    expert_activations = frozenset(GATED_OPS)  # the MoE kernels' (kernels/activation.py)

    small_batch_linear = SmallBatchLinear(cache=TILE_CACHE)  # one per process: engines reuse its measurements
    small_batch_moe = SmallBatchMoE(cache=TILE_CACHE)  # likewise

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)  # copied to the GPU without waiting

    def launch_chain(self, device: torch.device) -> dict[str, Any]:
        return launch.launch_chain(device)

    def kernel_helpers(self) -> KernelHelpers:
        return shared.HELPERS

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS:  # small decode batches: measured per shape
            return self.small_batch_linear(x, weight, bias)
        return super().linear(x, weight, bias)

    def rms_norm(
        self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        return norm.rms_norm(x, weight, eps, residual)

    def norm_linear(
        self,
        x: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight: Tensor,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        def unfused(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            return super(CudaOps, self).norm_linear(x, residual, norm_weight, eps, w, bias)

        if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS:  # small decode batches: measured per shape
            return self.small_batch_linear.norm_linear(x, residual, norm_weight, eps, weight, bias, unfused)
        return unfused(weight)

    def norm_route(
        self,
        x: Tensor,
        residual: Tensor | None,
        norm_weight: Tensor,
        eps: float,
        weight: Tensor,
        routing: Routing,
        correction_bias: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        def unfused(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            return super(CudaOps, self).norm_route(x, residual, norm_weight, eps, w, routing, correction_bias)

        if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and moe_routing.covers(routing):  # batch 1: measured
            return self.small_batch_linear.norm_route(x, residual, norm_weight, eps, weight, routing, correction_bias,
                                                      unfused)  # fmt: skip
        return unfused(weight)

    def layer_norm(
        self, x: Tensor, weight: Tensor, bias: Tensor, eps: float, residual: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        return norm.layer_norm(x, weight, bias, eps, residual)

    def rotary(
        self, q: Tensor, k: Tensor, positions: Tensor, cos_sin: Tensor, norms: HeadNorms | None = None
    ) -> tuple[Tensor, Tensor]:
        return rotary.rotary(q, k, positions, cos_sin, norms)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return activation.silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: Tensor) -> Tensor:
        return activation.gelu_tanh_and_mul(x)

    def gelu_and_mul(self, x: Tensor) -> Tensor:
        return activation.gelu_and_mul(x)

    def sigmoid_gate(self, y: Tensor, gate: Tensor) -> Tensor:
        return activation.sigmoid_gate(y, gate)

    def add_gated(self, base: Tensor, y: Tensor, x: Tensor, gate_weight: Tensor) -> Tensor:
        return activation.add_gated(base, y, x, gate_weight)

    def fused_moe(
        self,
        x: Tensor,
        w13: Tensor,
        w2: Tensor,
        topk_weights: Tensor,
        topk_ids: Tensor,
        activation: str,
        limit: float | None = None,
        shared_experts: int = 0,
    ) -> Tensor:
        if limit is not None:  # the kernels have no clamp yet: the reference (DeepSeek V4's experts)
            return super().fused_moe(x, w13, w2, topk_weights, topk_ids, activation, limit)
        tiles = None
        if x.is_cuda and 0 < topk_ids.numel() <= moe.MAX_SLOTS_PER_SLOT_PATH:  # small decode batches: measured
            tiles = self.small_batch_moe.tiles(x, w13, w2, topk_ids.shape[1], activation)
        # the shared experts of larger batches by the linears' measured kernels, as a separate MLP's
        return moe.fused_moe(x, w13, w2, topk_weights, topk_ids, activation, tiles, shared_experts, self.linear)

    def moe_route(self, logits: Tensor, routing: Routing, correction_bias: Tensor | None) -> tuple[Tensor, Tensor]:
        if not moe_routing.covers(routing):
            return super().moe_route(logits, routing, correction_bias)
        return moe_routing.moe_route(logits, routing, correction_bias)

    def write_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, slot_mapping: Tensor) -> None:
        """Store ``k``, ``v`` [T, Hkv, D] into ``cache`` in its format (the storing half
        of :meth:`attention`; benchmarks and tests fill caches with it)."""
        self._store(k, v, cache, slot_mapping)

    def write_shadow_kv(self, k: Tensor, v: Tensor, cache: LayerKVCache, shadow_slots: Tensor) -> None:
        kv_quant_write.write_shadow_kv(k, v, cache, shadow_slots)

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        # A quantized cache's write launch also stores the recent window's exact copies,
        # and for a rotated cache brings the queries into the keys' basis, once per
        # (token, head) instead of in every program that reads them.
        shadow_slots = meta.shadows.slot_mapping if meta.shadows is not None else None
        rotated_q = self._store(k, v, cache, meta.slot_mapping, q, shadow_slots)
        return attention.paged_attention_cache(q, cache, meta, scale, window, softcap, rotated_q=rotated_q)

    def rotary_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        rotation: Rotation,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """A cache in the model's dtype takes the rotated keys and the values from the rotary's
        launch; a quantized one from its own write launch (which also rotates the queries into
        its basis and fills the recent window), after the rotary's."""
        if cache.format.name != "auto":
            return super().rotary_attention(q, k, v, rotation, cache, meta, scale, window, softcap)
        q = rotary.rotary_write_kv(q, k, v, rotation.positions, rotation.cos_sin, rotation.norms, cache["k"],
                                   cache["v"], meta.slot_mapping)  # fmt: skip
        return attention.paged_attention_cache(q, cache, meta, scale, window, softcap)

    def encoder_attention(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
        """Every image of the batch in one launch."""
        return encoder_attention.encoder_attention(q, k, v, cu_seqlens, scale)

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
        return attention.paged_attention_cache(q, cache, meta, scale, window, softcap)

    @staticmethod
    def _store(
        k: Tensor,
        v: Tensor,
        cache: LayerKVCache,
        slot_mapping: Tensor,
        q: Tensor | None = None,
        shadow_slots: Tensor | None = None,
    ) -> Tensor | None:
        if cache.format.name == "auto":  # (the engine keeps no window over an unquantized cache)
            kv_write.write_kv(k, v, cache["k"], cache["v"], slot_mapping)
            return None
        return kv_quant_write.quant_write_kv(k, v, cache, slot_mapping, q, shadow_slots)

    def sample(self, logits: Tensor, params: SamplingBatch) -> Tensor:
        return sampling.sample(logits, params)

    def apply_token_bitmask(self, logits: Tensor, bitmask: Tensor, rows: Tensor) -> None:
        token_bitmask.apply_token_bitmask(logits, bitmask, rows)

    def capture_steps(self, forward: StepForward, limits: StepLimits, device: torch.device) -> StepGraphs:
        graphs = StepGraphs(forward, limits, device)  # its warm-up runs measure the small-batch linears
        for measured in (self.small_batch_linear, self.small_batch_moe):
            if (report := measured.report()) is not None:
                log.info(report)
        return graphs
