"""GGUF files of architecture ``deepseek2``: DeepSeek-V3/R1, Kimi-style fine-tunes, GLM-4.7-Flash.

llama.cpp's converter writes latent attention as multi-query attention over the latent (one KV head of
``kv_lora_rank + qk_rope_head_dim`` key and ``kv_lora_rank`` value dims) and keeps the per-head sizes as
``key_length_mla`` / ``value_length_mla``. It rotates adjacent pairs as the checkpoint does, so q and the
rope key are stored unchanged. Newer files hold ``kv_b_proj`` split per head into ``attn_k_b`` (transposed)
and ``attn_v_b``, older ones whole as ``attn_kv_b``: the model loads either. YaRN's ``mscale_all_dim`` is
written as ``yarn_log_multiplier`` = 0.1 * mscale_all_dim, its ``mscale`` not at all (DeepSeek's equal it).
The converter keeps the MTP layers (GLM-4.7-Flash's one), which loading skips
(:func:`xinfer.loading.gguf.load_gguf_config`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import Any

from gguf import ExpertGatingFuncType

from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf import DEEPSEEK_MOE_DEFAULTS, DEEPSEEK_MOE_KEYS, GGUFAdapter, read_fields

# config field -> "deepseek2.<key>", where the converter writes it: the latent's shape, then the experts'
_KEYS = {
    "q_lora_rank": ("attention.q_lora_rank", int),
    "kv_lora_rank": ("attention.kv_lora_rank", int),
    "v_head_dim": ("attention.value_length_mla", int),
    **DEEPSEEK_MOE_KEYS,
}


class DeepseekV2GGUF(GGUFAdapter):
    arch = "deepseek2"
    architecture = "DeepseekV3ForCausalLM"

    def __init__(self, model_type: str = "deepseek_v3", names_as: str | None = None) -> None:
        super().__init__(model_type, names_as)

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        arch = self.arch
        gating = metadata.get(f"{arch}.expert_gating_func", ExpertGatingFuncType.SOFTMAX)
        if int(gating) != ExpertGatingFuncType.SIGMOID:
            raise ModelFileError(
                f"{arch}.expert_gating_func: {arch} GGUF with softmax expert gating (DeepSeek-V2, V2.5) is not supported: xinfer reads "
                "V3-style files (sigmoid gating); load V2 from its safetensors checkpoint"
            )
        config = DEEPSEEK_MOE_DEFAULTS | read_fields(metadata, arch, _KEYS)
        rope_dim = int(metadata[f"{arch}.rope.dimension_count"])
        config |= {
            "architectures": [self.architecture],
            "q_lora_rank": config.get("q_lora_rank"),  # none written: no q-LoRA
            "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": int(metadata[f"{arch}.attention.key_length_mla"]) - rope_dim,
            "head_dim": rope_dim,
            "num_key_value_heads": fields["num_attention_heads"],
            "rope_interleave": True,
            "latent_norm_eps": fields["rms_norm_eps"],  # llama.cpp's for every norm, the latents' too
        }
        if fields.get("rope_scaling", {}).get("rope_type") == "yarn":
            config["rope_scaling"] = fields["rope_scaling"] | _yarn_scales(metadata, arch)
        return config


def _yarn_scales(metadata: Mapping[str, Any], arch: str) -> dict[str, float]:
    """YaRN's scales as llama.cpp applies them: the checkpoint's mscale_all_dim (``yarn_log_multiplier`` / 0.1)
    on the scores squared, the rotary part unscaled; without one (none written, or 0), YaRN's usual
    1 + 0.1 ln(factor) on the rotary part of q and of k, and on the scores squared."""
    mscale = float(metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
    if mscale:
        return {"mscale": mscale, "mscale_all_dim": mscale}
    usual = 1 + 0.1 * math.log(float(metadata[f"{arch}.rope.scaling.factor"]))
    return {"mscale_all_dim": 1.0, "attention_factor": usual}


# config field -> "deepseek32.<key>": the lightning indexer's shape and how many positions it keeps
_INDEXER_KEYS = {
    "index_n_heads": ("attention.indexer.head_count", int),
    "index_head_dim": ("attention.indexer.key_length", int),
    "index_topk": ("attention.indexer.top_k", int),
}


class DeepseekV32GGUF(DeepseekV2GGUF):
    """``deepseek32`` (DeepSeek-V3.2): ``deepseek2``'s latent attention and experts, and each layer's lightning
    indexer (``indexer.attn_q_b``, ``indexer.attn_k``, ``indexer.k_norm``, ``indexer.proj``). The gguf package
    names the tensors as for ``glm-dsa``."""

    arch = "deepseek32"
    architecture = "DeepseekV32ForCausalLM"

    def __init__(self) -> None:
        super().__init__(model_type="deepseek_v32", names_as="glm-dsa")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        indexer = read_fields(metadata, self.arch, _INDEXER_KEYS)
        if missing := [f"{self.arch}.{key}" for field, (key, _) in _INDEXER_KEYS.items() if field not in indexer]:
            raise ModelFileError(f"{', '.join(missing)} missing: xinfer cannot read a DeepSeek-V3.2 file without it")
        return super().config(metadata, fields, tensor_names) | indexer
