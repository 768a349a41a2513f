import json

import pytest
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from tests.tiny_models import COMMON, save_tiny_model
from xinfer import LLM
from xinfer.loading.weights import MissingWeightsError
from xinfer.registry import UnknownArchitectureError


def test_unknown_architecture_lists_the_registered_ones(tmp_path):
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownArchitectureError) as error:
        LLM(model=str(tmp_path), dtype="float32")
    assert "'NoSuchForCausalLM'" in str(error.value)
    assert "LlamaForCausalLM" in str(error.value) and "Qwen3ForCausalLM" in str(error.value)


def test_missing_weight_is_named(tmp_path):
    save_tiny_model(LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]), tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError) as error:
        LLM(model=str(tmp_path), dtype="float32")
    assert "model.layers.1.self_attn.qkv_proj.weight:k" in str(error.value)


def test_sharded_checkpoint_with_index_loads(tmp_path):
    from transformers import AutoModelForCausalLM
    import torch

    torch.manual_seed(0)
    config = LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"])
    model = AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(model=str(tmp_path), dtype="float32", num_blocks=32)
    ours = llm.engine.model.model.embed_tokens.weight
    assert torch.equal(ours, model.model.embed_tokens.weight)


def test_dummy_weights_need_no_checkpoint(tmp_path):
    LlamaConfig(**COMMON, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", load_format="dummy", num_blocks=32)
    weight = llm.engine.model.model.layers[0].mlp.down_proj.weight
    assert weight.std() > 0.01  # random, never zeros
