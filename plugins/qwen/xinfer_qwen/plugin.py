from xinfer.hooks import OpSpec, hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "Qwen2ForCausalLM": "xinfer_qwen.qwen:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "xinfer_qwen.qwen:Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM": "xinfer_qwen.qwen_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "xinfer_qwen.qwen_moe:Qwen3MoeForCausalLM",
        "Qwen3VLForConditionalGeneration": "xinfer_qwen.qwen3_vl:Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration": "xinfer_qwen.qwen3_vl:Qwen3VLMoeForConditionalGeneration",
        "Qwen3NextForCausalLM": "xinfer_qwen.qwen3_next:Qwen3NextForCausalLM",
        "Qwen3_5ForCausalLM": "xinfer_qwen.qwen3_next:Qwen3_5ForCausalLM",
        "Qwen3_5ForConditionalGeneration": "xinfer_qwen.qwen3_vl:Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForCausalLM": "xinfer_qwen.qwen3_next:Qwen3_5MoeForCausalLM",
        "Qwen3_5MoeForConditionalGeneration": "xinfer_qwen.qwen3_vl:Qwen3_5MoeForConditionalGeneration",
    }


@hookimpl
def xinfer_ops() -> list[OpSpec]:
    return [
        OpSpec("causal_conv1d", "xinfer_qwen.deltanet_ops:causal_conv1d",
               {"cuda": "xinfer_qwen.kernels.conv1d:causal_conv1d"},
               activations={"cuda": frozenset({"silu"})}),  # the kernel's SILU switch (kernels/conv1d.py)
        OpSpec("gated_delta_rule_norm", "xinfer_qwen.deltanet_ops:gated_delta_rule_norm",
               {"cuda": "xinfer_qwen.kernels.delta_rule:gated_delta_rule_norm"}),
    ]  # fmt: skip


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {
        "qwen2": "xinfer_qwen.gguf:QWEN2",
        "qwen3": "xinfer_qwen.gguf:QWEN3",
        "qwen2moe": "xinfer_qwen.gguf:QWEN2_MOE",
        "qwen3moe": "xinfer_qwen.gguf:QWEN3_MOE",
        "qwen3next": "xinfer_qwen.gguf:QWEN3_NEXT",
        "qwen35": "xinfer_qwen.gguf:QWEN3_5",
        "qwen35moe": "xinfer_qwen.gguf:QWEN3_5_MOE",
    }


@hookimpl
def xinfer_transformers_releases() -> dict[str, str]:
    return {
        **dict.fromkeys(("qwen3_vl", "qwen3_vl_moe", "qwen3_next"), "4.57.0"),
        **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"), "5.2.0"),
    }
