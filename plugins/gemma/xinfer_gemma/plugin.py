from xinfer.hooks import hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "Gemma3ForCausalLM": "xinfer_gemma.gemma3:Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration": "xinfer_gemma.gemma3_vision:Gemma3ForConditionalGeneration",
        "Gemma4ForCausalLM": "xinfer_gemma.gemma4:Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration": "xinfer_gemma.gemma4_vision:Gemma4ForConditionalGeneration",
    }


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"gemma3": "xinfer_gemma.gguf:Gemma3GGUF", "gemma4": "xinfer_gemma.gguf4:Gemma4GGUF"}


@hookimpl
def xinfer_transformers_releases() -> dict[str, str]:
    # 5.5 added Gemma 4; its config holds each layer's head dim and KV heads (per_layer_config) from 5.15 on
    return {"gemma4": "5.15.0", "gemma4_text": "5.15.0"}
