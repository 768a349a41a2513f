"""GGUF files of architectures ``qwen2``, ``qwen3``, ``qwen2moe`` and ``qwen3moe``, and of the
hybrids ``qwen3next``, ``qwen35`` and ``qwen35moe``.

llama.cpp runs these with NeoX-style rotary, so its converter stores q/k unpermuted
(unlike ``llama``): the tensors are the HF ones (the experts stacked per projection, which
the MoE block loads as they are). The MoE files carry the expert counts and sizes under
their own keys, and llama.cpp hard-codes whether the top-k weights are renormalized.

The hybrids' converter changes more (:class:`QwenHybridAdapter` undoes it): zero-centred norm
weights stored as ``1 + w``, ``A_log`` as ``-exp(A_log)``, Qwen3-Next's ``in_proj_qkvz`` split
in ``attn_qkv`` and ``attn_gate``, and for Qwen3.5 the value heads reordered from grouped by key
head (``[k0: v0 v1, k1: v0 v1, ..]``) to tiled (``[k0 k1 ..: v0, k0 k1 ..: v1]``) in every
tensor that has them; its ``block_count`` counts the MTP layers too, which are skipped.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from xinfer.loading.gguf import GGUFAdapter

QWEN2 = GGUFAdapter(model_type="qwen2")


class BiasedAdapter(GGUFAdapter):
    """An architecture whose attention biases a config field switches: on where the file has them (llama.cpp
    refuses a ``qwen3`` file with them, transformers applies them; a reader that dropped them ran another model)."""

    def __init__(self, model_type: str, bias_field: str):
        super().__init__(model_type)
        self.bias_field = bias_field

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        return {self.bias_field: "blk.0.attn_q.bias" in tensor_names}


QWEN3 = BiasedAdapter("qwen3", "attention_bias")

_MOE_KEYS = {
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}


class QwenMoeAdapter(BiasedAdapter):
    def __init__(self, arch: str, model_type: str, norm_topk_prob: bool, bias_field: str = "attention_bias"):
        super().__init__(model_type, bias_field)
        self.arch, self.norm_topk_prob = arch, norm_topk_prob

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        present = {field: f"{self.arch}.{key}" for field, key in _MOE_KEYS.items() if f"{self.arch}.{key}" in metadata}
        moe = {field: int(metadata[key]) for field, key in present.items()}
        return {**super().config(metadata, fields, tensor_names), **moe, "norm_topk_prob": self.norm_topk_prob}

    def undo_conversion(self, hf_name: str, tensor: Tensor, config: PretrainedConfig) -> Tensor:
        # llama.cpp reads the shared expert's gate as a vector; HF's is a [1, H] projection
        return tensor.reshape(1, -1) if hf_name.endswith("shared_expert_gate.weight") else tensor


QWEN2_MOE = QwenMoeAdapter("qwen2moe", "qwen2_moe", norm_topk_prob=False, bias_field="qkv_bias")
QWEN3_MOE = QwenMoeAdapter("qwen3moe", "qwen3_moe", norm_topk_prob=True)


# config field -> "<arch>.<key>" of the Gated DeltaNet layers
_SSM_KEYS = {
    "linear_conv_kernel_dim": "ssm.conv_kernel",
    "linear_key_head_dim": "ssm.state_size",
    "linear_num_key_heads": "ssm.group_count",
    "linear_num_value_heads": "ssm.time_step_rank",
}


class QwenHybridAdapter(QwenMoeAdapter):
    def __init__(self, arch: str, model_type: str, tiled_value_heads: bool, norm_topk_prob: bool | None = None):
        super().__init__(arch, model_type, norm_topk_prob=bool(norm_topk_prob))
        self.tiled_value_heads = tiled_value_heads
        self.renormalizes = norm_topk_prob is not None  # Qwen3.5-MoE always renormalizes: no such field

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        moe = super().config(metadata, fields, tensor_names)
        if not self.renormalizes:
            del moe["norm_topk_prob"]
        ssm = {field: int(metadata[f"{self.arch}.{key}"]) for field, key in _SSM_KEYS.items()}
        ssm["linear_value_head_dim"] = int(metadata[f"{self.arch}.ssm.inner_size"]) // ssm["linear_num_value_heads"]
        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        return {
            **moe,
            **ssm,
            "layer_types": self._layer_types(metadata, fields["num_hidden_layers"]),
            "partial_rotary_factor": int(metadata[f"{self.arch}.rope.dimension_count"]) / head_dim,
        }

    def _layer_types(self, metadata: Mapping[str, Any], layers: int) -> list[str]:
        """As llama.cpp reads them: the converter's per-layer ``attention.recurrent_layers`` (from the
        checkpoint's layer_types) where the file has them, else every ``full_attention_interval``-th layer
        (default 4) full attention."""
        if (recurrent := metadata.get(f"{self.arch}.attention.recurrent_layers")) is not None:
            return ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
        interval = int(metadata.get(f"{self.arch}.full_attention_interval", 4))
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]

    def undo_conversion(self, hf_name: str, tensor: Tensor, config: PretrainedConfig) -> Tensor:
        tensor = super().undo_conversion(hf_name, tensor, config)
        if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
            tensor = tensor - 1
        elif hf_name.endswith("A_log"):
            tensor = torch.log(-tensor)
        if self.tiled_value_heads and ".linear_attn." in hf_name:
            tensor = _value_heads_grouped(hf_name, tensor, config)
        return tensor


def _value_heads_grouped(hf_name: str, tensor: Tensor, config: PretrainedConfig) -> Tensor:
    """The value heads of a Gated DeltaNet tensor back in HF's order, grouped by key head."""
    num_k_heads, num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
    head_v_dim, qk_rows = config.linear_value_head_dim, 2 * num_k_heads * config.linear_key_head_dim

    def grouped(rows: Tensor, head_dim: int, dim: int = 0) -> Tensor:
        tiled = rows.unflatten(dim, (num_v_heads // num_k_heads, num_k_heads, head_dim))
        return tiled.transpose(dim, dim + 1).flatten(dim, dim + 2)

    module = hf_name.split(".")[-2] if hf_name.endswith(".weight") else hf_name.split(".")[-1]
    if module in ("in_proj_qkv", "conv1d"):  # q and k rows, then v's
        return torch.cat([tensor[:qk_rows], grouped(tensor[qk_rows:], head_v_dim)])
    if module == "in_proj_z":
        return grouped(tensor, head_v_dim)
    if module in ("in_proj_b", "in_proj_a", "A_log", "dt_bias"):
        return grouped(tensor, 1)
    if module == "out_proj":
        return grouped(tensor, head_v_dim, dim=1)
    return tensor


QWEN3_NEXT = QwenHybridAdapter("qwen3next", "qwen3_next", tiled_value_heads=False, norm_topk_prob=True)
QWEN3_5 = QwenHybridAdapter("qwen35", "qwen3_5_text", tiled_value_heads=True)
QWEN3_5_MOE = QwenHybridAdapter("qwen35moe", "qwen3_5_moe_text", tiled_value_heads=True)
