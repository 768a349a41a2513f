from xinfer.hooks import hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "LlamaForCausalLM": "xinfer_llama.llama:LlamaForCausalLM",
        "MistralForCausalLM": "xinfer_llama.llama:MistralForCausalLM",
        "Phi3ForCausalLM": "xinfer_llama.phi3:Phi3ForCausalLM",
    }


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"llama": "xinfer_llama.gguf:LlamaGGUF", "phi3": "xinfer_llama.gguf:Phi3GGUF"}
