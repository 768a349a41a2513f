from xinfer.hooks import hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "Qwen2ForCausalLM": "xinfer_qwen.qwen:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "xinfer_qwen.qwen:Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM": "xinfer_qwen.qwen_moe:Qwen2MoeForCausalLM",
        "Qwen3MoeForCausalLM": "xinfer_qwen.qwen_moe:Qwen3MoeForCausalLM",
    }


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"qwen2": "xinfer_qwen.gguf:QWEN2", "qwen3": "xinfer_qwen.gguf:QWEN3"}
