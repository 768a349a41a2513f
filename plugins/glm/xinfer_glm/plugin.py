from xinfer.hooks import hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {"Glm4ForCausalLM": "xinfer_glm.glm4:Glm4ForCausalLM"}


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"glm4": "xinfer_glm.gguf:Glm4GGUF"}
