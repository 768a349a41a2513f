from xinfer.hooks import OpSpec, hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "DeepseekV2ForCausalLM": "xinfer_deepseek.deepseek:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "xinfer_deepseek.deepseek:DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM": "xinfer_deepseek.deepseek_v32:DeepseekV32ForCausalLM",
        "Glm4MoeLiteForCausalLM": "xinfer_deepseek.glm4_moe_lite:Glm4MoeLiteForCausalLM",
    }


@hookimpl
def xinfer_ops() -> list[OpSpec]:
    kernels = {"cuda": "xinfer_deepseek.kernels.mla:mla_attention"}
    return [
        OpSpec("mla_attention", "xinfer_deepseek.mla_ops:mla_attention", kernels),
        OpSpec(
            "indexer_topk",
            "xinfer_deepseek.indexer_ops:indexer_topk",
            {"cuda": "xinfer_deepseek.kernels.indexer:indexer_topk"},
        ),
        OpSpec(
            "sparse_mla_attention",
            "xinfer_deepseek.sparse_mla_ops:sparse_mla_attention",
            {"cuda": "xinfer_deepseek.kernels.sparse_mla:sparse_mla_attention"},
        ),
    ]


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"deepseek2": "xinfer_deepseek.gguf:DeepseekV2GGUF"}
