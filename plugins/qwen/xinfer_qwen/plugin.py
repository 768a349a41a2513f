from xinfer.hooks import hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "Qwen2ForCausalLM": "xinfer_qwen.qwen:Qwen2ForCausalLM",
        "Qwen3ForCausalLM": "xinfer_qwen.qwen:Qwen3ForCausalLM",
    }
