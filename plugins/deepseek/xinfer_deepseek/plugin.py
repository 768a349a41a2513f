from xinfer.hooks import OpSpec, hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {
        "DeepseekV2ForCausalLM": "xinfer_deepseek.deepseek:DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM": "xinfer_deepseek.deepseek:DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM": "xinfer_deepseek.deepseek_v32:DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM": "xinfer_deepseek.deepseek_v4:DeepseekV4ForCausalLM",
        "Glm4MoeLiteForCausalLM": "xinfer_deepseek.glm4_moe_lite:Glm4MoeLiteForCausalLM",
    }


@hookimpl
def xinfer_ops() -> list[OpSpec]:
    def op(name: str, module: str) -> OpSpec:
        return OpSpec(
            name, f"xinfer_deepseek.{module}_ops:{name}", {"cuda": f"xinfer_deepseek.kernels.{module}:{name}"}
        )

    return [
        OpSpec("mla_rows", "xinfer_deepseek.mla_ops:mla_rows", {"cuda": "xinfer_deepseek.kernels.mla_rows:mla_rows"}),
        op("mla_attention", "mla"),
        op("mla_attention_fp8", "mla"),
        op("indexer_topk", "indexer"),
        op("sparse_mla_attention", "sparse_mla"),
        *(OpSpec(name, f"xinfer_deepseek.compressed_ops:{name}", {}) for name in COMPRESSED_OPS),
    ]


COMPRESSED_OPS = ("compress_windows", "compressed_indexer_topk", "v4_attention")  # DeepSeek V4's: references only


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"deepseek2": "xinfer_deepseek.gguf:DeepseekV2GGUF", "deepseek32": "xinfer_deepseek.gguf:DeepseekV32GGUF"}


@hookimpl
def xinfer_transformers_releases() -> dict[str, str]:
    return {"glm4_moe_lite": "5.0.0", "deepseek_v4": "5.8.0", "deepseek_v32": "5.11.0"}
