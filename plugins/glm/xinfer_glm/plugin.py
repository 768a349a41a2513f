from xinfer.hooks import hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "GlmForCausalLM": "xinfer_glm.glm:GlmForCausalLM",
        "Glm4ForCausalLM": "xinfer_glm.glm4:Glm4ForCausalLM",
        "Glm4MoeForCausalLM": "xinfer_glm.glm4_moe:Glm4MoeForCausalLM",
    }


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"glm4": "xinfer_glm.gguf:Glm4GGUF", "glm4moe": "xinfer_glm.gguf:Glm4MoeGGUF"}
