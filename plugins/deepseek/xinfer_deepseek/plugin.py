from xinfer.hooks import OpSpec, hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "DeepseekV2ForCausalLM": "xinfer_deepseek.deepseek:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "xinfer_deepseek.deepseek:DeepseekV3ForCausalLM",
        "Glm4MoeLiteForCausalLM": "xinfer_deepseek.glm4_moe_lite:Glm4MoeLiteForCausalLM",
    }


@hookimpl
def xinfer_ops() -> list[OpSpec]:
    return [
        OpSpec(name, f"xinfer_deepseek.mla_ops:{name}", {"cuda": f"xinfer_deepseek.kernels.mla:{name}"})
        for name in ("mla_attention", "mla_attention_fp8")
    ]


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"deepseek2": "xinfer_deepseek.gguf:DeepseekV2GGUF"}
