"""GGUF files of architectures ``glm4`` (GLM-4-0414) and ``glm4moe`` (GLM-4.5/4.6/4.7).

llama.cpp rotates GLM-4's q/k over adjacent pairs as HF does, and GLM-4.5's over halves as HF
does, so its converter stores the checkpoint's tensors unchanged (GLM-4's ``gate_up_proj`` fused
as ``ffn_up``, GLM-4.5's experts stacked per projection); the rotated share of each head is
``rope.dimension_count``. The MTP layers the converter keeps (GLM-4.5's, GLM-OCR's) loading skips.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gguf import ExpertGatingFuncType

from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf import DEEPSEEK_MOE_DEFAULTS, DEEPSEEK_MOE_KEYS, GGUFAdapter, read_fields


def _partial_rotary_factor(arch: str, metadata: Mapping[str, Any], fields: dict[str, Any]) -> float:
    head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
    return int(metadata.get(f"{arch}.rope.dimension_count", head_dim // 2)) / head_dim


class Glm4GGUF(GGUFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="glm4")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        return {
            "partial_rotary_factor": _partial_rotary_factor("glm4", metadata, fields),
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,  # q, k and v's; transformers' default: True
        }


class Glm4MoeGGUF(GGUFAdapter):
    """Whether q, k and v have biases and q, k norms the file shows only by their tensors."""

    def __init__(self) -> None:
        super().__init__(model_type="glm4_moe")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        gating = metadata.get("glm4moe.expert_gating_func", ExpertGatingFuncType.SIGMOID)
        if int(gating) != ExpertGatingFuncType.SIGMOID:
            raise ModelFileError(f"glm4moe.expert_gating_func: {ExpertGatingFuncType(int(gating)).name.lower()} "
                                 "gating is not GLM-4.5's (sigmoid), the only one xinfer reads for glm4moe")  # fmt: skip
        moe = DEEPSEEK_MOE_DEFAULTS | read_fields(metadata, "glm4moe", DEEPSEEK_MOE_KEYS)
        return {
            **moe,
            "partial_rotary_factor": _partial_rotary_factor("glm4moe", metadata, fields),
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
        }
