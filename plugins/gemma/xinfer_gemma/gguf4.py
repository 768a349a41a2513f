"""GGUF files of architecture ``gemma4`` (the text model), as llama.cpp's converter writes them.

The norms are stored as the checkpoint holds them (Gemma 4 multiplies by ``w``); the layer scalars
and the fused experts gain a ``.weight``; the router's projection and scale are ``ffn_gate_inp``'s, its
per-expert scale is the experts' down projection's ``.scale``. The metadata gives per layer whether it slides (``sliding_window_pattern``), its
KV heads and MLP width (an array where they differ by layer); the global layers' head dim is
``key_length``, the sliding layers' ``key_length_swa``. The global layers' proportional rope is the
``rope_freqs`` tensor: divisor 1 for each rotated pair, 1e30 (no rotation) for the rest.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf import GGUFAdapter

ARCH = "gemma4"
SLIDING_ROPE_BASE = 10_000.0
FINAL_SOFTCAP = 30.0
_UNROTATED = 1e29  # llama.cpp's converter writes 1e30 as the divisor of a pair it leaves unrotated


class Gemma4GGUF(GGUFAdapter):
    def __init__(self) -> None:
        super().__init__(model_type="gemma4_text")

    def config(
        self, metadata: Mapping[str, Any], fields: dict[str, Any], tensor_names: Collection[str]
    ) -> dict[str, Any]:
        layers = fields["num_hidden_layers"]
        sliding = [bool(flag) for flag in _required(metadata, "attention.sliding_window_pattern")]
        if len(sliding) != layers:
            raise ModelFileError(f"{ARCH}.attention.sliding_window_pattern: {len(sliding)} flags for {layers} layers")
        head_dim = int(_required(metadata, "attention.key_length_swa"))
        global_head_dim = int(_required(metadata, "attention.key_length"))
        for key, expected in (("attention.value_length_swa", head_dim), ("attention.value_length", global_head_dim),
                              ("rope.dimension_count_swa", head_dim), ("rope.dimension_count", global_head_dim)):  # fmt: skip
            if (value := metadata.get(f"{ARCH}.{key}", expected)) != expected:
                raise ModelFileError(f"{ARCH}.{key} = {value}: xinfer reads Gemma 4 only where it is {expected}")
        kv_heads = _per_layer(fields["num_key_value_heads"], layers)
        sliding_kv, global_kv = _one_per_kind(kv_heads, sliding, "attention.head_count_kv")
        shared = int(metadata.get(f"{ARCH}.attention.shared_kv_layers", 0))
        widths = _per_layer(fields["intermediate_size"], layers)
        double_wide = widths != [widths[0]] * layers
        if double_wide and widths != [widths[0] * (1 + (i >= layers - shared)) for i in range(layers)]:
            raise ModelFileError(
                f"{ARCH}.feed_forward_length: {widths}: only the KV-shared layers may be wider (twice)"
            )
        per_layer = int(metadata.get(f"{ARCH}.embedding_length_per_layer_input", 0))
        global_layers = [i for i, slides in enumerate(sliding) if not slides]
        return {
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "head_dim": head_dim,
            "num_key_value_heads": sliding_kv,
            "per_layer_config": {
                i: {"head_dim": global_head_dim, "num_key_value_heads": global_kv} for i in global_layers
            },
            "attention_k_eq_v": all(f"blk.{i}.attn_v.weight" not in tensor_names for i in global_layers),
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "intermediate_size": widths[0],
            "use_double_wide_mlp": double_wide,
            "num_kv_shared_layers": shared,
            "hidden_size_per_layer_input": per_layer,
            "vocab_size_per_layer_input": fields["vocab_size"],
            "rope_parameters": {
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": float(metadata.get(f"{ARCH}.rope.freq_base_swa", SLIDING_ROPE_BASE)),
                },
                "full_attention": fields.get("rope_parameters", {}).get("full_attention")
                or _proportional_rope(fields["rope_theta"], 1.0),
            },
            "architectures": ["Gemma4ForCausalLM"],
            # llama.cpp's cap where the file writes none (transformers' default is no cap)
            "final_logit_softcapping": fields.get("final_logit_softcapping", FINAL_SOFTCAP),
            **_experts(metadata),
        }

    def rope_freqs(self, divisors: list[float], fields: Mapping[str, Any]) -> dict[str, Any]:
        """The global layers' proportional rope: 1 for each rotated pair, then 1e30 for each other."""
        rotated = sum(1 for d in divisors if d == 1.0)
        if any(d != 1.0 for d in divisors[:rotated]) or any(d < _UNROTATED for d in divisors[rotated:]):
            raise ModelFileError(
                f"rope_freqs: {divisors}: xinfer reads Gemma 4's as 1 for each rotated pair, then 1e30"
            )
        return {
            "rope_parameters": {"full_attention": _proportional_rope(fields["rope_theta"], rotated / len(divisors))}
        }

    def converter_name(self, hf_name: str) -> str:
        module, _, name = hf_name.rpartition(".")
        if name in ("layer_scalar", "gate_up_proj"):
            return f"{hf_name}.weight"
        if module.endswith(".router"):  # the router's projection is HF's router.proj; its expert scales sit on down's
            return (
                f"{module.removesuffix('.router')}.experts.down_proj.scale"
                if name == "per_expert_scale"
                else f"{module}.proj.{name}"
            )
        return super().converter_name(hf_name)


def _experts(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """26B-A4B's experts beside each layer's dense MLP, where the file has them."""
    if f"{ARCH}.expert_count" not in metadata:
        return {}
    return {
        "enable_moe_block": True,
        "num_experts": int(metadata[f"{ARCH}.expert_count"]),
        "top_k_experts": int(_required(metadata, "expert_used_count")),
        "moe_intermediate_size": int(_required(metadata, "expert_feed_forward_length")),
    }


def _required(metadata: Mapping[str, Any], key: str) -> Any:
    if f"{ARCH}.{key}" not in metadata:
        raise ModelFileError(f"{ARCH}.{key} is missing: xinfer cannot read a Gemma 4 file without it")
    return metadata[f"{ARCH}.{key}"]


def _per_layer(value: int | list[int], layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [int(value)] * layers


def _one_per_kind(values: list[int], sliding: list[bool], key: str) -> tuple[int, int]:
    """The one value of the sliding layers and the one of the global layers."""
    kinds = {slides: {v for v, s in zip(values, sliding) if s == slides} for slides in (True, False)}
    if any(len(kind) > 1 for kind in kinds.values()):
        raise ModelFileError(
            f"{ARCH}.{key}: {values}: xinfer reads one value for the sliding and one for the global layers"
        )
    return next(iter(kinds[True] or kinds[False])), next(iter(kinds[False] or kinds[True]))


def _proportional_rope(theta: float, rotated: float) -> dict[str, Any]:
    return {"rope_type": "proportional", "rope_theta": float(theta), "partial_rotary_factor": rotated}
