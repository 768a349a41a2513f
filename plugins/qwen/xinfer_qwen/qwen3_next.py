"""Qwen3-Next and Qwen3.5 / Qwen3.6 (dense and MoE): hybrid decoders, Gated DeltaNet layers
(``layer_types``: ``linear_attention``) between full-attention layers, three to one.

Their full attention is Qwen3's with a sigmoid output gate (q's projection doubled), rotary
over a part of each head; every RMSNorm but the DeltaNet's output norm multiplies by
``1 + w``. Qwen3.5's rope is multimodal (mrope), which for text alone is plain rope. Its
checkpoints hold the language model under ``model.language_model`` beside a vision tower
(not loaded here) and multi-token-prediction layers (skipped).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

from torch import Tensor, nn

from xinfer.layers import DecoderForCausalLM, DecoderSpec, MoE, RMSNorm, RotaryEmbedding, Routing
from xinfer.loading.mtp import without_mtp_layers
from xinfer.model import HF_QKV_GATE_UP
from xinfer_qwen.gated_deltanet import GatedDeltaNet
from xinfer_qwen.qwen_moe import is_sparse, routing

log = logging.getLogger(__name__)


class DeltaNetDecoderLayer(nn.Module):
    """Pre-norm around a Gated DeltaNet (HF's ``linear_attn``) and an MLP, as
    :class:`xinfer.layers.DecoderLayer` around attention."""

    def __init__(self, linear_attn: GatedDeltaNet, mlp: nn.Module, norm: Callable[[], RMSNorm]):
        super().__init__()
        self.linear_attn = linear_attn
        self.mlp = mlp
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()

    def forward(self, positions: Tensor, h: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        h, residual = (self.input_layernorm(h), h) if residual is None else self.input_layernorm(h, residual)
        h = self.linear_attn(positions, h)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def text_part(weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """The language model's tensors under the names of a text-only checkpoint; the vision
    tower's are left out, with one log line."""
    logged = False
    for name, tensor in weights:
        if name.startswith("model.visual."):
            if not logged:
                log.info("skipping the checkpoint's vision tower (model.visual.*): xinfer runs the text part")
                logged = True
            continue
        yield name.replace("model.language_model.", "model.", 1), tensor


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 / Qwen3.6 dense; also the text part of ``Qwen3_5ForConditionalGeneration``."""

    spec = DecoderSpec(qk_norm=True, norm_weight_offset=1.0, output_gate=True)
    packed_modules = {
        **HF_QKV_GATE_UP,
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }
    fused_projections: ClassVar[bool] = False  # Qwen3-Next's in_proj_qkvz / in_proj_ba

    def layer(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        if config.layer_types[index] != "linear_attention":
            return super().layer(config, index, rotary)
        norm = functools.partial(self.rms_norm, config.hidden_size)
        return DeltaNetDecoderLayer(GatedDeltaNet(config, self.fused_projections), self.mlp(config, index), norm)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        return super().load_weights(without_mtp_layers(text_part(weights), self.config.num_hidden_layers))


def sparse_moe(config: Any, routing: Routing) -> MoE:
    """Routed experts and a shared expert scaled by ``sigmoid(shared_expert_gate(x))``."""
    return MoE(config.hidden_size, config.num_experts, config.moe_intermediate_size, routing, config.hidden_act,
               shared_intermediate_size=config.shared_expert_intermediate_size, shared_expert_gate=True)  # fmt: skip


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5 / Qwen3.6 MoE (Qwen3.6-35B-A3B); every layer's MLP is experts, the top-k
    weights renormalized."""

    def mlp(self, config: Any, index: int) -> nn.Module:
        return sparse_moe(config, Routing(top_k=config.num_experts_per_tok, renormalize=True))


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: Qwen3.5-MoE's layers with the DeltaNet's projections fused in two, their
    rows grouped per key head; dense MLPs where Qwen2-MoE's rules say (``decoder_sparse_step``,
    ``mlp_only_layers``)."""

    packed_modules = {**HF_QKV_GATE_UP, "in_proj_qkvz": ("in_proj", "qkvz"), "in_proj_ba": ("in_proj", "ba")}
    fused_projections = True

    def mlp(self, config: Any, index: int) -> nn.Module:
        return sparse_moe(config, routing(config)) if is_sparse(config, index) else super().mlp(config, index)
