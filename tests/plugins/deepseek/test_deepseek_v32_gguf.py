"""A GGUF of architecture ``deepseek32`` (DeepSeek-V3.2) written here as llama.cpp's converter writes one
(``deepseek2``'s latent attention and experts, ``kv_b_proj`` split, plus each layer's lightning indexer and
its shape and top-k as metadata), through the engine against transformers' modeling code of the model it came
from (prompts long enough for the indexer to select) and against llama.cpp itself."""

import gguf
import pytest

from tests.llama_cpp_oracle import assert_llama_cpp_agrees
from tests.plugins.deepseek.test_deepseek_gguf import write_deepseek2_gguf
from tests.plugins.deepseek.test_deepseek_v32 import deepseek_v32_config
from tests.plugins.hf_parity import (
    assert_greedy_tokens_and_logprobs_match,
    assert_prefill_logits_match,
    randomize,
    spread_routing,
)
from tests.tiny_models import save_tiny_model
from xinfer import LLM
from xinfer.loading.errors import ModelFileError
from xinfer.loading.gguf import load_gguf_config


def write_deepseek32_gguf(folder, config, path, indexer_keys: bool = True, mtp_layers: int = 0) -> None:
    """``mtp_layers``: how many of the file's blocks it says are MTP layers (the converter keeps them)."""

    def indexer(writer: gguf.GGUFWriter) -> None:
        if mtp_layers:
            writer.add_nextn_predict_layers(mtp_layers)
        if indexer_keys:
            writer.add_indexer_head_count(config.index_n_heads)
            writer.add_indexer_key_length(config.index_head_dim)
            writer.add_indexer_top_k(config.index_topk)

    write_deepseek2_gguf(folder, config, path, split=True, arch="deepseek32", names_as=gguf.MODEL_ARCH.GLM_DSA,
                         add_metadata=indexer)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek32-gguf")
    # indexer heads of 64 dims: at the safetensors tests' 16 llama.cpp's graph fails to build (its Hadamard
    # rotation of the indexer's q and k does not take 16 dims)
    hf = save_tiny_model(deepseek_v32_config(index_head_dim=64), folder)
    randomize(hf)
    spread_routing(hf)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


@pytest.fixture(scope="module")
def models(checkpoint):
    hf, folder = checkpoint
    path = folder / "tiny.gguf"
    write_deepseek32_gguf(folder, hf.config, path)
    return hf, LLM(model=str(path), dtype="float32", num_blocks=64), path


def test_config_reads_the_indexer(models):
    hf, _, path = models
    config = load_gguf_config(path)
    assert config.architectures == ["DeepseekV32ForCausalLM"]
    for field in ("num_hidden_layers", "index_n_heads", "index_head_dim", "index_topk", "q_lora_rank", "kv_lora_rank"):
        assert getattr(config, field) == getattr(hf.config, field), field


@pytest.mark.parametrize("length", (3, 40))  # 40: the indexer keeps 8 of the positions
def test_prefill_logits_match_hf(models, length):
    hf, llm, _ = models
    assert_prefill_logits_match(hf, llm, length)


def test_greedy_tokens_and_logprobs_match_hf(models):
    hf, llm, _ = models
    assert_greedy_tokens_and_logprobs_match(hf, llm, 17)


def test_llama_cpp_reads_the_gguf_alike(models):
    _, llm, path = models
    assert_llama_cpp_agrees(llm, path)


def test_block_count_less_the_mtp_layers_is_the_models_depth(checkpoint, tmp_path):
    """llama.cpp runs ``block_count - nextn_predict_layers`` layers; so does xinfer."""
    hf, folder = checkpoint
    write_deepseek32_gguf(folder, hf.config, tmp_path / "mtp.gguf", mtp_layers=1)
    assert load_gguf_config(tmp_path / "mtp.gguf").num_hidden_layers == hf.config.num_hidden_layers - 1


def test_a_file_without_the_indexer_keys_is_one_error_naming_them(checkpoint, tmp_path):
    hf, folder = checkpoint
    write_deepseek32_gguf(folder, hf.config, tmp_path / "no-indexer.gguf", indexer_keys=False)
    with pytest.raises(ModelFileError, match=r"no-indexer\.gguf: deepseek32\.attention\.indexer\.head_count"):
        load_gguf_config(tmp_path / "no-indexer.gguf")
