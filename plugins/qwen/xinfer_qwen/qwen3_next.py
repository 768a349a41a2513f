"""Qwen3-Next and Qwen3.5 / Qwen3.6 (dense and MoE): hybrid decoders, Gated DeltaNet layers
(``layer_types``: ``linear_attention``) between full-attention layers, three to one.

Their full attention is Qwen3's with a sigmoid output gate (q's projection doubled), rotary
over a part of each head; every RMSNorm but the DeltaNet's output norm multiplies by
``1 + w``. Qwen3.5's rope is multimodal (mrope), which for text alone is plain rope; its
image-text checkpoints are :mod:`xinfer_qwen.qwen3_vl`'s. Multi-token-prediction layers are
skipped.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from xinfer.layers import DecoderForCausalLM, DecoderSpec, MoE, RMSNorm, RotaryEmbedding, Routing, normed_block
from xinfer.loading.mtp import without_mtp_layers
from xinfer.loading.stored import StoredTensor, Weights, whole
from xinfer.model import HF_QKV_GATE_UP
from xinfer.quant import QuantizedTensor
from xinfer_qwen.gated_deltanet import GatedDeltaNet
from xinfer_qwen.qwen_moe import is_sparse, routing


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
        h, residual = normed_block(self.linear_attn, self.input_layernorm, h, residual, positions)
        return normed_block(self.mlp, self.post_attention_layernorm, h, residual)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    """Qwen3.5 / Qwen3.6 dense (the text model of ``Qwen3_5ForConditionalGeneration``)."""

    spec = DecoderSpec(qk_norm=True, mlp_bias=False, norm_weight_offset=1.0, output_gate=True, partial_rotary=True)
    packed_modules = {
        **HF_QKV_GATE_UP,
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
    }

    def layer(self, config: Any, index: int, rotary: RotaryEmbedding) -> nn.Module:
        if config.layer_types[index] != "linear_attention":
            return super().layer(config, index, rotary)
        norm = functools.partial(self.rms_norm, config.hidden_size)
        return DeltaNetDecoderLayer(GatedDeltaNet(config), self.mlp(config, index), norm)

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(without_mtp_layers(text_model(weights), self.config.num_hidden_layers))


def text_model(weights: Weights) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """The text model's tensors under a text-only checkpoint's names: transformers saves this class, loaded from
    an image-text checkpoint, with that checkpoint's ``model.language_model.``. A vision encoder's tensors
    (``model.visual.``) are left as they are: the image-text classes take them, a text-only one reports them
    unused."""
    prefix = "model.language_model."
    for name, tensor in weights:
        yield ("model." + name.removeprefix(prefix) if name.startswith(prefix) else name), tensor


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
    """Qwen3-Next: Qwen3.5-MoE's layers but dense MLPs where Qwen2-MoE's rules say
    (``decoder_sparse_step``, ``mlp_only_layers``), and the DeltaNet's projections fused in
    two, ``in_proj_qkvz`` and ``in_proj_ba``, whose rows come per key head (``q | k | v | z``
    and ``b | a``, the key head's share of the value heads in each): they are split into
    Qwen3.5's four at load."""

    def mlp(self, config: Any, index: int) -> nn.Module:
        return sparse_moe(config, routing(config)) if is_sparse(config, index) else super().mlp(config, index)

    def checkpoint_names(self) -> set[str]:
        """Qwen3.5's but ``in_proj_ba`` for ``in_proj_b`` and ``in_proj_a``, and ``in_proj_qkvz``
        besides ``in_proj_qkv`` and ``in_proj_z`` (llama.cpp's converter splits it in those two)."""
        names = super().checkpoint_names()
        split = {name for name in names if name.endswith((".in_proj_b.weight", ".in_proj_a.weight"))}
        fused = {name.replace(".in_proj_qkv.", ".in_proj_qkvz.") for name in names if ".in_proj_qkv." in name}
        return names - split | fused | {name.replace(".in_proj_b.", ".in_proj_ba.") for name in split}

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights(unfused(weights, self.config))


def unfused(weights: Weights, config: Any) -> Iterator[tuple[str, Tensor | StoredTensor]]:
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` split into Qwen3.5's ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, the rows of each in head order."""
    group = config.linear_num_value_heads // config.linear_num_key_heads
    key, value = config.linear_key_head_dim, config.linear_value_head_dim * group
    per_key_head = {  # fused module: the rows of one key head, and where each part goes
        "in_proj_qkvz": ([key, key, value, value], ["in_proj_qkv", "in_proj_qkv", "in_proj_qkv", "in_proj_z"]),
        "in_proj_ba": ([group, group], ["in_proj_b", "in_proj_a"]),
    }
    for name, tensor in weights:
        module_path, _, leaf = name.rpartition(".")
        prefix, _, module = module_path.rpartition(".")
        if module not in per_key_head:
            yield name, tensor
            continue
        sizes, targets = per_key_head[module]
        values = whole(tensor)
        rows: dict[str, list[Tensor]] = {}
        row_numbers = torch.arange(values.shape[0]).unflatten(0, (config.linear_num_key_heads, -1))
        for target, part in zip(targets, row_numbers.split(sizes, dim=1)):
            rows.setdefault(target, []).append(part.flatten())
        for target, parts in rows.items():
            yield f"{prefix}.{target}.{leaf}", _rows(values, torch.cat(parts))


def _rows(tensor: Tensor, index: Tensor) -> Tensor:
    """Rows ``index`` of a weight, a packed one (a GGUF's quantized ``ssm_ba``) kept packed."""
    if not isinstance(tensor, QuantizedTensor):
        return tensor[index]
    if tensor.parts:
        return tensor.dequantize()[index]
    return QuantizedTensor(tensor.raw[index], tensor.format, (len(index), *tensor.logical_shape[1:]))
