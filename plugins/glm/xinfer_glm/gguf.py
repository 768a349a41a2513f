"""GGUF files of architecture ``glm4`` (GLM-4-0414).

llama.cpp rotates GLM-4's q/k over adjacent pairs as HF does, so its converter stores the
checkpoint's tensors unchanged (``gate_up_proj`` fused as ``ffn_up``); the rotated share of
each head is ``rope.dimension_count``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from xinfer.loading.gguf import GGUFAdapter


class Glm4GGUF(GGUFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="glm4")

    def config(self, metadata: Mapping[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        rotated = int(metadata.get("glm4.rope.dimension_count", head_dim // 2))
        return {"partial_rotary_factor": rotated / head_dim}
