"""GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's layers, the dense ones named by ``mlp_layer_types``."""

from __future__ import annotations

from typing import Any

from xinfer_deepseek.deepseek import DeepseekV3ForCausalLM


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    default_rope_ignores_partial = False  # transformers' GLM-4.7-Flash sizes even its default table by the factor

    def is_sparse(self, config: Any, index: int) -> bool:
        return config.mlp_layer_types[index] == "sparse"
