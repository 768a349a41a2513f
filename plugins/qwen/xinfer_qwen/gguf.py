"""GGUF files of architectures ``qwen2``, ``qwen3``, ``qwen2moe`` and ``qwen3moe``.

llama.cpp runs these with NeoX-style rotary, so its converter stores q/k unpermuted
(unlike ``llama``): the tensors are the HF ones (the experts stacked per projection, which
the MoE block loads as they are). The MoE files carry the expert counts and sizes under
their own keys, and llama.cpp hard-codes whether the top-k weights are renormalized.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import Tensor
from transformers import PretrainedConfig

from xinfer.loading.gguf import GGUFAdapter

QWEN2 = GGUFAdapter(model_type="qwen2")
QWEN3 = GGUFAdapter(model_type="qwen3")

_MOE_KEYS = {
    "num_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length",
}


class QwenMoeAdapter(GGUFAdapter):
    def __init__(self, arch: str, model_type: str, norm_topk_prob: bool):
        super().__init__(model_type)
        self.arch, self.norm_topk_prob = arch, norm_topk_prob

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        present = {field: f"{self.arch}.{key}" for field, key in _MOE_KEYS.items() if f"{self.arch}.{key}" in metadata}
        return {**{field: int(metadata[key]) for field, key in present.items()}, "norm_topk_prob": self.norm_topk_prob}

    def undo_conversion(self, hf_name: str, tensor: Tensor, config: PretrainedConfig) -> Tensor:
        # llama.cpp reads the shared expert's gate as a vector; HF's is a [1, H] projection
        return tensor.reshape(1, -1) if hf_name.endswith("shared_expert_gate.weight") else tensor


QWEN2_MOE = QwenMoeAdapter("qwen2moe", "qwen2_moe", norm_topk_prob=False)
QWEN3_MOE = QwenMoeAdapter("qwen3moe", "qwen3_moe", norm_topk_prob=True)
