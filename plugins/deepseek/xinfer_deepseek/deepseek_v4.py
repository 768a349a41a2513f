"""DeepSeek V4 (``DeepseekV4ForCausalLM``; V4-Flash, V4-Pro): compressed attention in every layer
(:mod:`xinfer_deepseek.compressed_attention`), the residual as hyper-connected streams
(:mod:`xinfer_deepseek.hyper_connections`), and a mixture of experts in every layer, the first
``hash_moe`` layers routed by a fixed token-to-expert table.

The router scores are ``scoring_func(logits)`` (``sqrt(softplus(logits))`` in the checkpoints; any plain
activation, as transformers' ``ACT2FN`` takes it, but no softmax); the top ``num_experts_per_tok`` by score plus
``e_score_correction_bias`` (learned-routing layers), their scores renormalised and scaled by
``routed_scaling_factor``; routed and shared experts clamp their SwiGLU at ``swiglu_limit``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn

from xinfer.layers import MoE, RMSNorm, Routing
from xinfer.layers.activation import activation_name
from xinfer.layers.embedding import LMHead, VocabEmbedding
from xinfer.loading.stored import StoredTensor, Weights, whole
from xinfer.model import CausalLM
from xinfer_deepseek.checkpoint_v4 import hf_names
from xinfer_deepseek.compressed_attention import CompressedAttention
from xinfer_deepseek.hyper_connections import HyperConnection, HyperHead

log = logging.getLogger(__name__)


class DecoderLayer(nn.Module):
    """Attention and MoE, each between a hyper-connection's collapse and expansion of the streams,
    each after its pre-norm (``input_layernorm``, ``post_attention_layernorm``)."""

    def __init__(self, config: Any, index: int):
        super().__init__()
        hc = (config.hc_mult, config.hidden_size, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.self_attn = CompressedAttention(config, index)
        self.mlp = _moe(config, index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, positions: Tensor, streams: Tensor, input_ids: Tensor) -> Tensor:
        x, post, comb = self.attn_hc.collapse(streams)
        streams = self.attn_hc.expand(self.self_attn(positions, self.input_layernorm(x)), streams, post, comb)
        x, post, comb = self.ffn_hc.collapse(streams)
        return self.ffn_hc.expand(self.mlp(self.post_attention_layernorm(x), input_ids), streams, post, comb)


def _moe(config: Any, index: int) -> MoE:
    hashed = config.mlp_layer_types[index] == "hash_moe"
    routing = Routing(
        top_k=config.num_experts_per_tok,
        scoring=activation_name(config.scoring_func, "scoring_func"),
        renormalize=True,  # (the reference renormalises whatever norm_topk_prob says)
        correction_bias=not hashed,
        scaling_factor=config.routed_scaling_factor,
        fixed_table=hashed,
    )
    return MoE(
        config.hidden_size, config.n_routed_experts, config.moe_intermediate_size, routing, config.hidden_act,
        shared_intermediate_size=config.moe_intermediate_size, shared_name="shared_experts",
        shared_bias=config.mlp_bias, vocab_size=config.vocab_size, swiglu_limit=config.swiglu_limit,
    )  # fmt: skip


class DeepseekV4Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.streams = config.hc_mult
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        h = self.embed_tokens(input_ids)
        streams = h.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(CausalLM):
    """HF names (DeepSeek's own are renamed at load, :mod:`xinfer_deepseek.checkpoint_v4`: MXFP4 experts
    kept packed, FP8 projections dequantized there). The MTP layer (``mtp.*``) is loaded and kept as the checkpoint stores it, in host
    memory (:attr:`mtp`), not run: xinfer has no speculative decoding to run it in."""

    cuda_graphs = False  # (the compressed ops are torch references: loops over the sequences)
    decodes_quantized_checkpoint = True  # DeepSeek's own names: ``X.scale`` beside FP8 and MXFP4 weights
    packed_modules = {
        "shared_experts.gate_proj": ("shared_experts.gate_up_proj", "gate"),
        "shared_experts.up_proj": ("shared_experts.gate_up_proj", "up"),
    }

    def __init__(self, config: Any):
        super().__init__(config)
        self.model = DeepseekV4Model(config)
        self.lm_head = LMHead.of(config, self.model.embed_tokens)
        self.mtp: dict[str, Tensor] = {}

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(self._keeping_mtp(hf_names(weights)))

    def _keeping_mtp(self, weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
        for name, tensor in weights:
            if name.startswith("mtp."):
                kept = whole(tensor)  # in host memory: nothing reads it on the device (the fit check's: on meta)
                self.mtp[name] = kept if kept.is_meta else kept.to("cpu")
                continue
            yield name, tensor
        if self.mtp:
            size = sum(t.numel() * t.element_size() for t in self.mtp.values()) / 2**30
            log.info(
                "kept the MTP layer's %d tensors (%.2f GiB as stored, in host memory): not run, xinfer has no "
                "speculative decoding",
                len(self.mtp),
                size,
            )
