"""GGUF files of architecture ``minimax-m2``.

llama.cpp rotates MiniMax-M2's q/k over halves as HF does, so its converter stores the checkpoint's
tensors unchanged (the experts stacked per projection); the rotated share of each head is
``rope.dimension_count``, the routing's scoring function ``expert_gating_func``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gguf import ExpertGatingFuncType

from xinfer.loading.gguf import GGUFAdapter

GATING_KEY = "minimax-m2.expert_gating_func"


class MiniMaxM2GGUF(GGUFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="minimax_m2")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        gating = int(metadata.get(GATING_KEY, ExpertGatingFuncType.SIGMOID))
        if gating not in {kind.value for kind in ExpertGatingFuncType}:
            known = ", ".join(f"{kind.value} ({kind.name.lower()})" for kind in ExpertGatingFuncType)
            raise ValueError(f"GGUF key {GATING_KEY} = {gating} is no gating function llama.cpp defines: {known}")
        return {
            "num_local_experts": int(metadata["minimax-m2.expert_count"]),
            "num_experts_per_tok": int(metadata["minimax-m2.expert_used_count"]),
            "scoring_func": ExpertGatingFuncType(gating).name.lower(),
            "partial_rotary_factor": int(metadata.get("minimax-m2.rope.dimension_count", head_dim)) / head_dim,
        }
