"""GGUF files of architecture ``gemma3`` (the text model).

llama.cpp's converter stores Gemma's RMSNorm weights as ``w + 1`` (Gemma normalizes with
``1 + w``); the HF checkpoint holds ``w``. The metadata leaves out what llama.cpp
hard-codes for Gemma 3: the rope base of the sliding layers, the 5-sliding-1-global layer
pattern and the query scale.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import Tensor
from transformers import PretrainedConfig

from xinfer.loading.gguf import GGUFAdapter

LOCAL_ROPE_BASE = 10000.0
GLOBAL_LAYER_EVERY = 6
_GEMMA3_27B_LAYERS = 62


class Gemma3GGUF(GGUFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="gemma3_text")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        layers = fields["num_hidden_layers"]
        head_dim = fields.get("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
        # as llama.cpp: 27B scales queries by hidden/heads (168), every other size by head_dim
        scalar = fields["hidden_size"] // fields["num_attention_heads"] if layers == _GEMMA3_27B_LAYERS else head_dim
        sliding = _sliding_layers(metadata.get("gemma3.attention.sliding_window_pattern"), layers)
        if "sliding_window" not in fields:  # none written, or 0: as llama.cpp, every layer global
            sliding = [False] * layers
        return {
            "rope_local_base_freq": float(metadata.get("gemma3.rope.freq_base_swa", LOCAL_ROPE_BASE)),
            "query_pre_attn_scalar": scalar,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        }

    def undo_conversion(self, hf_name: str, tensor: Tensor, config: PretrainedConfig) -> Tensor:
        return tensor - 1.0 if hf_name.endswith("norm.weight") else tensor


def _sliding_layers(pattern: Any, layers: int) -> list[bool]:
    """Per layer, whether it slides: from the file's pattern when it has one (a period N,
    the last layer of each N global, or one flag per layer), else llama.cpp's period 6."""
    if pattern is None or isinstance(pattern, int):
        every = int(pattern or GLOBAL_LAYER_EVERY)
        return [(i + 1) % every != 0 for i in range(layers)]
    return [bool(flag) for flag in pattern]
