"""GGUF files of architecture ``deepseek2``: DeepSeek-V3/R1, Kimi-style fine-tunes, GLM-4.7-Flash.

llama.cpp's converter writes latent attention as multi-query attention over the latent (one KV head of
``kv_lora_rank + qk_rope_head_dim`` key and ``kv_lora_rank`` value dims) and keeps the per-head sizes as
``key_length_mla`` / ``value_length_mla``. It rotates adjacent pairs as the checkpoint does, so q and the
rope key are stored unchanged. Newer files hold ``kv_b_proj`` split per head into ``attn_k_b`` (transposed)
and ``attn_v_b``, older ones whole as ``attn_kv_b``: the model loads either. YaRN's ``mscale_all_dim`` is
written as ``yarn_log_multiplier`` = 0.1 * mscale_all_dim, its ``mscale`` not at all (DeepSeek's equal it).
The MTP layers are left out of the file.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from gguf import ExpertGatingFuncType

from xinfer.loading.gguf import DEEPSEEK_MOE_KEYS, GGUFAdapter, read_fields

# config field -> "deepseek2.<key>", where the converter writes it: the latent's shape, then the experts'
_KEYS = {
    "q_lora_rank": ("attention.q_lora_rank", int),
    "kv_lora_rank": ("attention.kv_lora_rank", int),
    "v_head_dim": ("attention.value_length_mla", int),
    **DEEPSEEK_MOE_KEYS,
}


class DeepseekV2GGUF(GGUFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="deepseek_v3")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        gating = metadata.get("deepseek2.expert_gating_func", ExpertGatingFuncType.SOFTMAX)
        if int(gating) != ExpertGatingFuncType.SIGMOID:
            raise ValueError(
                "deepseek2 GGUF with softmax expert gating (DeepSeek-V2, V2.5) is not supported: xinfer reads "
                "V3-style files (sigmoid gating); load V2 from its safetensors checkpoint"
            )
        config = read_fields(metadata, "deepseek2", _KEYS)
        rope_dim = int(metadata["deepseek2.rope.dimension_count"])
        config |= {
            "architectures": ["DeepseekV3ForCausalLM"],
            "q_lora_rank": config.get("q_lora_rank"),  # none written: no q-LoRA
            "n_group": config.get("n_group", 1),  # none written: no group limit, as llama.cpp reads it
            "topk_group": config.get("topk_group", 1),
            "norm_topk_prob": config.get("norm_topk_prob", False),
            "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": int(metadata["deepseek2.attention.key_length_mla"]) - rope_dim,
            "head_dim": rope_dim,
            "num_key_value_heads": fields["num_attention_heads"],
            "rope_interleave": True,
        }
        log_multiplier = metadata.get("deepseek2.rope.scaling.yarn_log_multiplier")
        if "rope_scaling" in fields and log_multiplier is not None:
            mscale = float(log_multiplier) / 0.1
            config["rope_scaling"] = {**fields["rope_scaling"], "mscale": mscale, "mscale_all_dim": mscale}
        return config
