from xinfer.hooks import hookimpl


@hookimpl
def xinfer_architectures() -> dict[str, str]:
    return {"MiniMaxM2ForCausalLM": "xinfer_minimax.minimax_m2:MiniMaxM2ForCausalLM"}


@hookimpl
def xinfer_gguf_architectures() -> dict[str, str]:
    return {"minimax-m2": "xinfer_minimax.gguf:MiniMaxM2GGUF"}


@hookimpl
def xinfer_transformers_releases() -> dict[str, str]:
    return {"minimax_m2": "5.0.0"}
