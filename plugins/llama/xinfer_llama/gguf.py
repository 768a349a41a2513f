"""GGUF files of architectures ``llama`` (Llama, Mistral, SmolLM, ...) and ``phi3``.

For ``llama`` llama.cpp rotates q/k with adjacent pairs (GPT-J style) where HF rotates the
two halves of each head (NeoX style), so its converter reorders the rows of every q/k head from
``[x0..x(d/2-1), y0..y(d/2-1)]`` to ``[x0, y0, x1, y1, ...]``. Undoing that (``pairs_to_halves``)
gives back the HF rows, which our rotary (rotate-half) expects.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from torch import Tensor
from transformers import PretrainedConfig

from xinfer.layers import pairs_to_halves
from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf import GGUFAdapter


class LlamaGGUF(GGUFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="llama")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        if metadata.get("llama.expert_count", 0):
            raise ModelFileError("llama.expert_count: this llama GGUF is a mixture of experts (Mixtral's, as "
                                 "llama.cpp's converter writes it), which xinfer does not run: no MixtralForCausalLM")  # fmt: skip
        # llama.cpp adds each bias the file has; the converter writes them where HF's config sets these
        return {
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,  # q, k, v and o's
            "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        }

    def undo_conversion(self, hf_name: str, tensor: Tensor, config: PretrainedConfig) -> Tensor:
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return pairs_to_halves(tensor, config.num_attention_heads)
        if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            return pairs_to_halves(tensor, config.num_key_value_heads)
        return tensor


class Phi3GGUF(GGUFAdapter):
    """Phi3 as llama.cpp's converter writes it: the checkpoint's tensors unchanged (its
    rope for phi3 rotates halves, as HF's does; qkv and gate_up stay fused), and the
    rotated share of each head as ``rope.dimension_count``. LongRoPE's factor tensors
    (Phi-3-128k, Phi-3.5, Phi-4-mini) the core reads, as llama.cpp applies them."""

    def __init__(self) -> None:
        super().__init__(model_type="phi3")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        head_dim = fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        rotated = int(metadata.get("phi3.rope.dimension_count", head_dim))
        # llama.cpp attends to every earlier position whatever attention.sliding_window says: it disables
        # Phi-3's window until its converter writes which layers slide
        window = {"sliding_window": None}
        return window if rotated == head_dim else {**window, "partial_rotary_factor": rotated / head_dim}
